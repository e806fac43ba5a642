#!/usr/bin/env bash
# Regenerate docs/benchmarks.md and docs/img/bench_*.png (see benchmarks/README.md).
#
# Run from anywhere, on a quiet machine (other load distorts every number, torch's most of all).
# Resumable: after an interruption, run this script again; rows already in
# benchmarks/results.jsonl are kept. Delete that file to measure everything afresh.
set -euo pipefail
cd "$(dirname "$0")/.."

# Spec-Bench, first question of each of its 13 categories, 64 new tokens, batch 1, greedy;
# jspec methods with their defaults (and n-gram with K=4), Hugging Face generate and its
# assisted modes as peers; throughput of ar at batch sizes 1 and 8. About 25 minutes here.
jspec bench \
    --methods "ar,ngram,ngram:max_draft=4,layer-skip,early-exit" \
    --prompts ../shared/data/spec_bench.jsonl --limit 1 \
    --max-new-tokens 64 --batch-size 1 --batch-sizes 1,8 --batch-methods ar \
    --hf --hf-assisted \
    --output benchmarks/results.jsonl --resume \
    --markdown docs/benchmarks.md --plots docs/img
