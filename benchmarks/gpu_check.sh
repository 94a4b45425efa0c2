#!/usr/bin/env bash
# The GPU checks in one run: the CUDA tests, then the decode/prefill step benchmark
# and the engine benchmark for padded vs triton vs triton + CUDA graphs.
#
#   bash benchmarks/gpu_check.sh OUT_DIR          # under 9 min on one H100/H200
#
# Installs nothing from the network. Python packages missing on the GPU machine
# (msgspec, xxhash, cbor2, gguf on a plain PyTorch image) are taken from wheels in
# .whl/ when that folder exists (see docs/engine.md, "Measuring on a GPU").
# Writes OUT_DIR/log.txt (everything printed) and one CSV per benchmark; each
# stage has its own time limit, so one hang costs only its stage.
set -uo pipefail
OUT=${1:?usage: gpu_check.sh OUT_DIR}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
LOG="$OUT/log.txt"
stage() { echo; echo "=== $1 ($(date -u +%H:%M:%S))"; }

{
    stage "device"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"

    stage "CUDA tests"
    timeout 170 python3 -m pytest -m cuda -q -p no:cacheprovider --maxfail=5 \
        tests/test_triton_attention.py tests/test_cuda_graphs.py tests/test_fused_kernels.py \
        tests/test_model.py \
        tests/test_forward_batch.py tests/test_engine.py tests/test_engine_host_tier.py \
        tests/test_engine_hardening.py tests/test_kvpool.py tests/test_smollm2.py \
        --durations=8 -rs 2>&1

    stage "decode step and prefill attention (SmolLM2-135M shape)"
    (cd benchmarks && timeout 110 python3 bench_decode.py --sweep --out "$OUT/decode.csv")

    for attn in padded "triton --no-cuda-graphs" triton; do
        name=$(echo "$attn" | sed 's/ --no-cuda-graphs/_nographs/')
        stage "engine, SmolLM2 shape, $attn"
        (cd benchmarks && timeout 70 python3 bench_engine.py --model smollm2-shape \
            --system-len 512 --turns 2 --modes off,radix-fcfs --max-num-seqs 32 --attention $attn \
            --out "$OUT/engine_$name.csv")
    done
    stage "done"
} 2>&1 | tee "$LOG"
