#!/bin/bash
# tools/distill_input.py on the device machine (issue 12's lead: sparsity-aware distillation on
# far more text than a 2-core box trains on). SmolLM2's file (98 MB) is larger than the device
# tool's 64 MiB working tree, so it goes in two calls, in halves, while the machine stays warm:
#
#   here:    mkdir -p xfer && split -b 49M models/SmolLM2-135M-Instruct.Q4_1.gguf xfer/sm. &&
#            grep -qx /xfer/ .git/info/exclude || echo /xfer/ >> .git/info/exclude
#   call 1:  carry ["xfer/sm.aa"], command: mkdir -p /tmp/keep && cp xfer/sm.aa /tmp/keep/
#   call 2:  carry ["xfer/sm.ab", ".whl"], command: S=0.4 STEPS=1500 OUT=$OUT bash tools/gpu_distill.sh
#            (SCALES=1: only a scale per output channel trains, lr about 1e-3; LR, BATCH, EVERY)
#
# Call 2 joins the halves, builds the kernels (pyinfer's Engine reads the file), writes the
# texts from the machine's own Python: training = the standard library's modules and their
# pydoc pages, except textwrap, heapq, bisect and fractions, whose sources (code) and pydoc pages
# (prose) are held out; then runs the distillation. $OUT/distill.log: the table.
set -o pipefail
OUT=${OUT:-/tmp/gpu_distill}
mkdir -p "$OUT" /tmp/dtext
if ls .whl/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONUNBUFFERED=1
M=/tmp/keep/smollm2.gguf
[ -f "$M" ] || cat /tmp/keep/sm.aa xfer/sm.ab > "$M" || exit 1
python3 setup.py build_ext --inplace -j 8 > "$OUT/build.log" 2>&1 || { tail "$OUT/build.log"; exit 1; }
python3 - <<'PY' || exit 1
import importlib, os, pydoc, sysconfig
lib = sysconfig.get_paths()["stdlib"]
held = ("textwrap", "heapq", "bisect", "fractions")
code, prose, n = [], [], 0
with open("/tmp/dtext/train.txt", "w") as tr:
    for f in sorted(os.listdir(lib)):
        name = f[:-3]
        if not f.endswith(".py") or name.startswith("_") or name == "antigravity":
            continue
        src = open(os.path.join(lib, f), errors="replace").read()
        try:
            doc = pydoc.render_doc(importlib.import_module(name), renderer=pydoc.plaintext)
        except Exception:
            doc = ""
        if name in held:
            code.append(src)
            prose.append(doc)
        else:
            tr.write(src + "\n\n" + doc + "\n\n")
            n += 1
open("/tmp/dtext/code.txt", "w").write("\n\n".join(code))
open("/tmp/dtext/prose.txt", "w").write("\n\n".join(prose))
print(n, "training modules")
PY
python3 tools/distill_input.py "$M" --train /tmp/dtext/train.txt \
    --held /tmp/dtext/code.txt /tmp/dtext/prose.txt --sparsity "${S:-0.4}" \
    --steps "${STEPS:-1500}" --batch "${BATCH:-4}" --ctx 512 --lr "${LR:-3e-5}" \
    --eval-every "${EVERY:-500}" --eval-chunks 8 --device cuda ${SCALES:+--scales} 2>&1 | tee "$OUT/distill.log"
