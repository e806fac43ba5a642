#!/usr/bin/env bash
# Regenerate docs/benchmarks.md and docs/img/bench_*.png (see benchmarks/README.md).
#
# Run from anywhere, on a quiet machine (other load distorts every number, torch's most of all).
# Resumable: after an interruption, run this script again; rows already in
# benchmarks/results.jsonl are kept. Delete that file to measure everything afresh.
set -euo pipefail
cd "$(dirname "$0")/.."

# The draft model of `--method draft` (no offline model shares SmolLM2's tokenizer): the default
# model's first 6 layers and its shipped EESD exit layer as a 7-layer model (make_draft_model.py).
[ -d build/smollm2-135m-draft ] || python benchmarks/make_draft_model.py build/smollm2-135m-draft

# Spec-Bench, first two questions of each of its 13 categories, 64 new tokens, batch 1, greedy;
# jspec methods with their defaults (and n-gram with K=4), Hugging Face generate and its
# assisted modes as peers; throughput of ar at batch sizes 1 and 8. About 35 minutes here.
jspec bench \
    --methods "ar,ngram,ngram:max_draft=4,layer-skip,early-exit,draft:draft_model=build/smollm2-135m-draft" \
    --limit 2 \
    --max-new-tokens 64 --batch-size 1 --batch-sizes 1,8 --batch-methods ar \
    --hf --hf-assisted \
    --output benchmarks/results.jsonl --resume \
    --markdown docs/benchmarks.md --plots docs/img

# Trained heads (issue: EESD and Kangaroo): Spec-Bench, first question of each category, 128 new
# tokens, batch 1 and 8; the shipped heads with their defaults (K = 1 on a CPU), the EESD head
# at K = 4 under the thompson, fixed and confidence controllers, HF generate as the peer. Its own results file and
# report section ("heads"); benchmarks/ship_head.py writes the heads' cards from these rows.
jspec bench \
    --methods "ar,eesd,kangaroo,eesd:max_draft=4,eesd:max_draft=4;controller=fixed,eesd:max_draft=4;controller=confidence" \
    --limit 1 \
    --max-new-tokens 128 --batch-size 1 --batch-sizes 1,8 --batch-methods ar,eesd,kangaroo \
    --hf \
    --output benchmarks/results_heads.jsonl --resume \
    --markdown docs/benchmarks.md --section heads --plots docs/img/heads
