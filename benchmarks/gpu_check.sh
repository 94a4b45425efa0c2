#!/usr/bin/env bash
# The GPU checks of the kernels in one device call: the CUDA tests; bench_decode.py's
# config sweep on the selection shapes (it chooses the triton launch configs) and the
# same chosen configs on held-out shapes; the engine benchmark for padded vs triton vs
# triton + CUDA graphs. gpu_smollm2.sh is the second call (SmolLM2's real weights and the
# serving load generator).
#
#   bash benchmarks/gpu_carry.sh                  # here, once: wheels and SmolLM2's halves
#   bash benchmarks/gpu_check.sh OUT_DIR          # on the GPU: about 7 min (estimated from the H200 run's stages)
#
# Installs nothing from the network (gpu_env.sh). Writes OUT_DIR/log.txt (everything
# printed), one CSV per benchmark and configs.json (the chosen launch configs, also kept
# in /tmp for the next call); each stage has its own time limit, so one hang costs only
# its stage. Selection shapes: 32 decodes at 1-2k tokens, prefill 4x1024, 1x4096,
# 16x512. Held out: 64 decodes at 256-768 with prefill 8x256 and 2x2048; 8 decodes at 3-4k.
set -uo pipefail
OUT=${1:?usage: gpu_check.sh OUT_DIR}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
LOG="$OUT/log.txt"
stage() { echo; echo "=== $1 ($(date -u +%H:%M:%S))"; }
CONFIGS=/tmp/radixkv-configs.json

{
    stage "device"
    source benchmarks/gpu_env.sh
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"

    stage "CUDA tests"
    timeout 200 python3 -m pytest -m cuda -q -p no:cacheprovider --maxfail=5 \
        tests/model/test_triton_attention.py tests/model/test_cuda_graphs.py tests/model/test_fused_kernels.py \
        tests/model/test_model.py tests/model/test_forward_batch.py tests/engine/test_engine.py \
        tests/engine/test_engine_host_tier.py tests/engine/test_engine_hardening.py tests/model/test_kvpool.py \
        tests/engine/test_prompt_scores.py tests/model/test_smollm2.py \
        --durations=8 -rs 2>&1

    cd benchmarks
    stage "selection: decode step and prefill attention, config sweep (SmolLM2-135M shape)"
    timeout 200 python3 bench_decode.py --sweep --profile --save-configs "$CONFIGS" \
        --out "$OUT/decode.csv"
    cp "$CONFIGS" "$OUT/configs.json" 2>/dev/null

    stage "held out, with the chosen configs: 64 decodes at 256-768, prefill 8x256 and 2x2048"
    with=()
    [ -f "$CONFIGS" ] && with=(--configs "$CONFIGS")
    timeout 150 python3 bench_decode.py --seqs 64 --ctx 256-768 --prefill-shapes 8x256,2x2048 \
        --sweep "${with[@]}" --out "$OUT/decode_heldout_64.csv"
    stage "held out, with the chosen configs: 8 decodes at 3-4k"
    timeout 70 python3 bench_decode.py --seqs 8 --ctx 3000-4000 --skip-prefill --sweep \
        "${with[@]}" --out "$OUT/decode_heldout_8.csv"

    for attn in padded "triton --no-cuda-graphs" triton; do
        name=$(echo "$attn" | sed 's/ --no-cuda-graphs/_nographs/')
        stage "engine, SmolLM2 shape, $attn"
        timeout 70 python3 bench_engine.py --model smollm2-shape \
            --system-len 512 --turns 2 --modes off,radix-fcfs --max-num-seqs 32 --attention $attn \
            --out "$OUT/engine_$name.csv"
    done
    stage "done"
} 2>&1 | tee "$LOG"
