# Sourced by gpu_check.sh and gpu_heldout.sh, from the repository root: Python finds this
# checkout, and the wheels in .whl/ (packages a plain PyTorch GPU image lacks: msgspec,
# xxhash, cbor2, gguf) when that folder exists. Installs nothing from the network.
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/radixkv-site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/radixkv-site:$PWD${PYTHONPATH:+:$PYTHONPATH}
else
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
