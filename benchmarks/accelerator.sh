#!/usr/bin/env bash
# The Spec-Bench comparison on whatever accelerator JAX sees (a GPU or TPU build of jax): every
# jspec method with its defaults, prompt lookup in front of the heads and SpecEE (the fastest
# settings on a CPU), and two heads' top 4 side by side (--candidates 4, which a CPU's wider
# verification eats, docs/journal/2026-11-27_candidates-side-by-side.md), batch 1 and 8, bfloat16,
# greedy, into docs/benchmarks-accelerator.md, whose report names the device
# (jax.devices()[0].device_kind) and the date. No HF peers: they run torch on the CPU, which is not what this page measures.
#
# Run from anywhere. Resumable, like run_all.sh: after an interruption (or a per-command time
# limit) run it again; the rows already in $OUTPUT are kept. Delete that file to start afresh.
#
# Environment, all optional (the test shrinks the run with them):
#   MODEL           a model folder, GGUF file or hub id (default: jspec's default model); another
#                   model needs its own METHODS (the draft model and heads below fit the default)
#   METHODS         jspec bench --methods (default: every method, below)
#   PROMPTS         a prompts file or shipped set (default: spec_bench, Spec-Bench's questions)
#   LIMIT           questions per category (default: 5, 65 questions; empty: all 480)
#   MAX_NEW_TOKENS  (default: 128)
#   OUTPUT, PAGE    the results JSONL and the report page (default: benchmarks/results/DATE_accelerator.jsonl,
#                   DATE today's, YYYY-MM-DD, so the default resumes within a day; and
#                   docs/benchmarks-accelerator.md); the plots go to img/accelerator beside PAGE.
#                   Set OUTPUT to one file to resume a run across days.
# Relative paths are taken from the repository root.
set -euo pipefail
cd "$(dirname "$0")/.."

DRAFT=build/smollm2-135m-draft  # the draft model of run_all.sh (benchmarks/make_draft_model.py)
METHODS=${METHODS:-"ar,auto,draft:draft_model=$DRAFT,early-exit,eesd,kangaroo,eagle,knn-ssd,layer-skip,ngram,mjsd,specee,eesd:lookup=2,kangaroo:lookup=2,eagle:lookup=2,specee:lookup=2,eagle:candidates=4,kangaroo:candidates=4"}
LIMIT=${LIMIT-5}
OUTPUT=${OUTPUT:-benchmarks/results/$(date +%F)_accelerator.jsonl}
PAGE=${PAGE:-docs/benchmarks-accelerator.md}

case $METHODS in
    *"draft_model=$DRAFT"*) [ -d "$DRAFT" ] || python benchmarks/make_draft_model.py "$DRAFT" ;;
esac
python -c 'import jax; d = jax.devices()[0]; print(f"measuring on {d.platform} ({d.device_kind})" +
    (": JAX sees no accelerator" if d.platform == "cpu" else ""))'

jspec bench \
    --methods "$METHODS" \
    --prompts "${PROMPTS:-spec_bench}" ${LIMIT:+--limit "$LIMIT"} \
    --max-new-tokens "${MAX_NEW_TOKENS:-128}" --batch-size 1 --batch-sizes 1,8 \
    --dtype bfloat16 ${MODEL:+--model "$MODEL"} \
    --output "$OUTPUT" --resume \
    --markdown "$PAGE" --section accelerator --plots "$(dirname "$PAGE")/img/accelerator"
