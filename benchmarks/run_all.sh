#!/usr/bin/env bash
# Regenerate docs/benchmarks.md and docs/img/bench_*.png (see benchmarks/README.md).
#
# Run from anywhere, on a quiet machine (other load distorts every number, torch's most of all).
# Resumable: after an interruption, run this script again; rows already in
# benchmarks/results.jsonl are kept. Delete that file to measure everything afresh.
set -euo pipefail
cd "$(dirname "$0")/.."

# Spec-Bench, first 5 questions of each of its 13 categories (65 questions), 128 new tokens,
# batch 1, greedy; jspec methods with their defaults, Hugging Face generate and its assisted
# modes as peers; throughput of every jspec method at batch sizes 1 and 8.
jspec bench \
    --methods ar,ngram,layer-skip,early-exit \
    --prompts ../shared/data/spec_bench.jsonl --limit 5 \
    --max-new-tokens 128 --batch-size 1 --batch-sizes 1,8 \
    --hf --hf-assisted \
    --output benchmarks/results.jsonl --resume \
    --markdown docs/benchmarks.md --plots docs/img
