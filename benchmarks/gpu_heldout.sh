#!/usr/bin/env bash
# Held-out check of the triton kernels' launch configs (chosen on gpu_check.sh's shapes:
# 32 decodes at 1-2k contexts; prefill 4x1024, 1x4096, 16x512) on shapes they were not
# chosen on, plus the final decode figures with the chosen configs.
#
#   bash benchmarks/gpu_heldout.sh OUT_DIR     # ~2.5 min on one H100/H200
set -uo pipefail
OUT=${1:?usage: gpu_heldout.sh OUT_DIR}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
{
    echo "=== kernel tests with the chosen configs"
    timeout 60 python3 -m pytest -m cuda -q -p no:cacheprovider tests/test_triton_attention.py \
        tests/test_cuda_graphs.py 2>&1 | tail -3
    cd benchmarks
    echo "=== final: the selection shape with the chosen configs"
    timeout 50 python3 bench_decode.py --skip-prefill --out "$OUT/decode_final.csv"
    echo "=== held out: 64 decodes at 256-768, prefill 8x256 and 2x2048"
    timeout 70 python3 bench_decode.py --seqs 64 --ctx 256-768 --prefill-shapes 8x256,2x2048 \
        --sweep --out "$OUT/decode_heldout_64.csv"
    echo "=== held out: 8 decodes at 3-4k"
    timeout 50 python3 bench_decode.py --seqs 8 --ctx 3000-4000 --skip-prefill --sweep \
        --out "$OUT/decode_heldout_8.csv"
} 2>&1 | tee "$OUT/log.txt"
