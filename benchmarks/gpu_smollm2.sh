#!/usr/bin/env bash
# The second GPU call: SmolLM2-135M's real weights on the GPU, and the serving load
# generator. Its GGUF (94 MB) is more than one call carries (64 MiB), so gpu_carry.sh cut
# it in halves: the first call (gpu_check.sh) carries .gpu_carry/a, this one, on the same
# warm machine, .gpu_carry/b (gpu_env.sh assembles them). Without both halves the model
# stages say so and the serving stage runs the random model instead.
#
#   bash benchmarks/gpu_smollm2.sh OUT_DIR        # about 4 min (estimated; not yet run)
#
# Stages: the CUDA tests of test_smollm2.py (GPU logits == the CPU's and transformers';
# engine greedy tokens with graphs on == off == padded == the CPU, cache on and off);
# bench_engine.py on SmolLM2 for padded vs triton vs triton + graphs, cache off vs radix;
# bench_serve.py's one-engine row (radixkv serve under the multi-turn chat load) for the
# same three, in bfloat16, and cache off for triton + graphs.
set -uo pipefail
OUT=${1:?usage: gpu_smollm2.sh OUT_DIR}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
LOG="$OUT/log.txt"
stage() { echo; echo "=== $1 ($(date -u +%H:%M:%S))"; }

{
    stage "device"
    source benchmarks/gpu_env.sh
    python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
    model=random
    if [ -n "$SMOLLM2_GGUF" ]; then
        model=smollm2
        stage "CUDA tests, SmolLM2's real weights"
        timeout 150 python3 -m pytest -m cuda -q -p no:cacheprovider tests/model/test_smollm2.py \
            --durations=5 -rs 2>&1
    fi

    cd benchmarks
    if [ "$model" = smollm2 ]; then
        for attn in padded "triton --no-cuda-graphs" triton; do
            name=$(echo "$attn" | sed 's/ --no-cuda-graphs/_nographs/')
            stage "engine, SmolLM2, $attn"
            timeout 60 python3 bench_engine.py --model smollm2 --system-len 512 --turns 2 \
                --modes off,radix-fcfs --max-num-seqs 32 --attention $attn \
                --out "$OUT/engine_smollm2_$name.csv"
        done
    fi

    common="--dtype bfloat16 --max-num-seqs 32"
    for variant in "padded:--attention-backend padded --enforce-eager" \
        "triton:--attention-backend triton --enforce-eager" \
        "triton_graphs:--attention-backend triton" \
        "triton_graphs_cache_off:--attention-backend triton --no-enable-prefix-caching"; do
        name=${variant%%:*}
        stage "serving load generator, $model, one engine, $name"
        timeout 80 python3 bench_serve.py --model $model --routers "" --num-blocks 4096 \
            --conversations 32 --turns 3 --groups 4 --concurrency 16 \
            --serve-args "$common ${variant#*:}" --out "$OUT/serve_$name.csv"
    done
    stage "done"
} 2>&1 | tee "$LOG"
