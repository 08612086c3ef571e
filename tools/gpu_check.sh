#!/bin/bash
# One prepared device run for issue 10 (the device tool's `run`, repository root, wheels for
# gguf and highspy carried in .whl/ as /work/.library/device/README.md says):
#
#   BASE=<commit> ALL=1 bash tools/gpu_check.sh  # $OUT: summary.log and logs.tar.gz (every
#                                                # step's log); stdout: the tables, summary last
#
# Builds this tree and BASE (optional: another commit, for the before/after pairs, built beside
# it in /tmp/base), runs the GPU tests (session 29's kernel forms, not yet the default, included:
# test_hybrid's OTHER_FORMS), then, in order of what is least known:
#   ffnvar   tools/ffn_variants_gpu.py: the sparse FFN's two kernels at a 7B q4_0 layer, the
#            engine's forms against the other gate/up dots and AXPY unrolls/chunks, and the rest
#            of the layer with session 29's forms (RMSNorm in registers, the GEMVs' wide dots)
#   new7ab   tools/bench_gpu.py 7B q4_0 at 100% and 50%, with --forms-ab (session 29's forms,
#            hybrid and -ngl; WIDE_AB=1 adds --wide-ab, the gate/up dots other than the
#            default, measured in session 28; GATE_UP_AB=1 --gate-up-ab, the listed form)
#   gemvvar  tools/gemv_variants_gpu.py: the q4_0 / q8_0 GEMV's dots in isolation (the engine's,
#            its wide form, wide with 1-8 blocks a lane and 1-2 rows a warp, q4_0 with the
#            activation's block sums given), the 7B / 13B shapes
#   new13    13B at 100% (all on the GPU: the sparse / dense ratio), with --forms-ab --ngl-axpy
#   profile  tools/profile_gpu.py: per-kernel device time of a 7B q4_0 token (8 layers), all on
#            the GPU sparse and dense, and the hybrid at 50% with its host steps in situ
# and with ALL=1 the measurements sessions 23-28 made and nothing since has changed:
#   cold32   tools/bench_cold.py over 32 distinct layers
#   cold     tools/bench_cold.py: the host's cold path by thread count, BASE's build against
#            this one where BASE is given
#   base7h   BASE's 7B hybrid at 50% (where BASE is given)
#   input7   tools/bench_gpu_input.py (sparse mode input, 7B q4_0, 25% / 50%)
#   avxvnni  (CPU only, where the host lists avx_vnni) the build variant with AVX-VNNI's VEX dot
#            (PYINFER_AVX2_VNNI=1: -mavxvnni) computes right on a real AVX-VNNI core (passed
#            in session 28)
# Each step has its own timeout, cut to what is left of LIMIT seconds (default 570), so the
# whole run ends inside ten minutes; what finished is in $OUT even when a later step is cut or
# skipped.
set -o pipefail
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
if ls .whl/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONUNBUFFERED=1
L=$OUT/summary.log
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; git log --oneline -1; } > "$L" 2>&1
s=$(date +%s)
if [ -n "$BASE" ] && [ -n "$ALL" ]; then  # only ALL's steps use BASE's build
    mkdir -p /tmp/base && git archive "$BASE" | tar -x -C /tmp/base
    (cd /tmp/base && python3 setup.py build_ext --inplace -j 8 > "$OUT/build_base.log" 2>&1) &
fi
python3 setup.py build_ext --inplace -j 8 > "$OUT/build.log" 2>&1
wait
echo "builds $(( $(date +%s) - s )) s" >> "$L"
B="--tokens 16 --warmup 3 --threads $(nproc) --qtype q4_0"
LIMIT=${LIMIT:-570}
step() {
    local t=$1 name=$2
    shift 2
    local s0=$(date +%s)
    local left=$(( LIMIT - (s0 - s) ))
    [ "$left" -lt 30 ] && { echo "$name skipped (${left} s left)" >> "$L"; return; }
    [ "$t" -gt "$left" ] && t=$left
    timeout "$t" "$@" > "$OUT/$name.log" 2>&1
    echo "$name rc=$? $(( $(date +%s) - s0 )) s" >> "$L"
}
step 180 pytest python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_hybrid.py tests/test_cuda_host.py tests/test_families.py
step 90 ffnvar python3 tools/ffn_variants_gpu.py --shape 7b --qtype q4_0
AB="--forms-ab --ngl-axpy ${WIDE_AB:+--wide-ab} ${GATE_UP_AB:+--gate-up-ab}"
step 240 new7ab python3 tools/bench_gpu.py $B --shape 7b --budgets 1.0,0.5 $AB
step 120 gemvvar python3 tools/gemv_variants_gpu.py --reps 30
step 150 new13 python3 tools/bench_gpu.py $B --shape 13b --budgets 1.0 $AB
step 90 profile python3 tools/profile_gpu.py --shape 7b --qtype q4_0 --layers 8 --threads "$(nproc)" \
    --no-ceilings --only sparse,dense,hybrid
if [ -n "$ALL" ]; then
    step 90 cold32 python3 tools/bench_cold.py --threads 8 $(nproc) --layers 32 --reps 5
    SO=$(ls /tmp/base/pyinfer/ops/_kernels*.so 2>/dev/null | head -1)
    step 90 cold python3 tools/bench_cold.py --threads 1 4 8 $(nproc) --reps 5 ${SO:+--so $SO}
    [ -n "$BASE" ] && step 90 base7h bash -c "cd /tmp/base && python3 tools/bench_gpu.py $B --shape 7b --budgets 0.5"
    step 150 input7 python3 tools/bench_gpu_input.py --shape 7b --qtype q4_0 --sparsity 0.25 0.5 \
        --tokens 32 --reps 3 --threads "$(nproc)"
    grep -qw avx_vnni /proc/cpuinfo && step 120 avxvnni python3 -m pytest -q -p no:cacheprovider \
        -m slow tests/test_kernels.py -k "build_variants and AVX2_VNNI"
fi
# stdout keeps only its last 12,000 characters: the long tables first, the summary last
[ -f "$OUT/gemvvar.log" ] && { echo "== gemvvar (block 256)"; grep -E "^(q|  block 256)" "$OUT/gemvvar.log"; }
[ -f "$OUT/profile.log" ] && { echo "== profile"; grep -vE "^(built|device)" "$OUT/profile.log" | head -60; }
for f in ffnvar new7ab cold32 cold base7h input7 new13; do
    [ -f "$OUT/$f.log" ] && { echo "== $f"; grep -E "^\|" "$OUT/$f.log"; }
done
tail -3 "$OUT/pytest.log"
[ -f "$OUT/avxvnni.log" ] && tail -2 "$OUT/avxvnni.log"
cat "$L"
# the device tool brings back a few files: every log in one archive, the summary beside it
(cd "$OUT" && tar -czf logs.tar.gz --exclude=logs.tar.gz --exclude=summary.log ./*.log \
    && find . -name '*.log' ! -name summary.log -delete)
