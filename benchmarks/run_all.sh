#!/usr/bin/env bash
# Regenerate the first section of docs/benchmarks.md and docs/img/bench_*.png (see benchmarks/README.md).
#
# Run from anywhere, on a quiet machine (other load distorts every number, torch's most of all).
# The rows go to benchmarks/results/DATE_run-all.jsonl, DATE today's (YYYY-MM-DD): the newest
# dated run-all file there is the one the table in docs/benchmarks.md came from.
# Resumable within a day: after an interruption, run this script again the same day; rows already
# in that day's file are kept (on another day it starts a new file). Delete the file to measure
# everything afresh.
set -euo pipefail
cd "$(dirname "$0")/.."
OUTPUT=benchmarks/results/$(date +%F)_run-all.jsonl

# The draft model of `--method draft` (no offline model shares SmolLM2's tokenizer): the default
# model's first N layers and its shipped EESD head's layers as one model: 4 + 2 with the head shipped now
# (make_draft_model.py).
[ -d build/smollm2-135m-draft ] || python benchmarks/make_draft_model.py build/smollm2-135m-draft

# Spec-Bench, the first question of each of its 13 categories, 128 new tokens, greedy,
# batch 1: every jspec method with its defaults (the trained heads alone and behind prompt lookup,
# the lossy methods with their output's NLL), Hugging Face generate as the peer, and the
# throughput of the fastest methods at batch sizes 1 and 8. About 40 minutes on a 2-core CPU.
jspec bench \
    --methods "ar,ngram,eagle,kangaroo,eesd,eagle:lookup=2,kangaroo:lookup=2,eesd:lookup=2,layer-skip,knn-ssd,early-exit,draft:draft_model=build/smollm2-135m-draft,specee,specee:lookup=2,mjsd" \
    --limit 1 \
    --max-new-tokens 128 --batch-size 1 --batch-sizes 1,8 --batch-methods "ar,ngram,eagle,kangaroo,kangaroo:lookup=2" \
    --hf \
    --output "$OUTPUT" --resume \
    --markdown docs/benchmarks.md --plots docs/img
