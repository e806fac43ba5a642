#!/usr/bin/env bash
# Search the nine domains' sublayer skip sets and the pooled set for the default model, then fit
# the anchors into checkpoints/smollm2-135m-instruct/knn-ssd/. The objective is the cost model
# (--objective modeled), which other work on a shared machine cannot disturb, so the searches run
# side by side in four chains. Rerunning resumes every search from its trial log.
#   bash benchmarks/knn_search_all.sh [SETS_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
sets=${1:-benchmarks/knn_sets}
budget=(--objective modeled --trials 8 --count 2 --max-new-tokens 24)
search() { jspec search-skip "${budget[@]}" --out "$sets/$1.json" "${@:2}"; }
pooled() {
  jspec search-skip --objective modeled --trials "${POOLED_TRIALS:-10}" --count 9 --max-new-tokens 24 \
    --all-buckets --out "$sets/pooled.json" --prompts benchmarks/knn_pooled_prompts.jsonl
}
chain_b() {
  search coding --prompts train_prompts --category coding
  search writing --prompts train_prompts --category writing
  search math --prompts train_prompts --category math
}
chain_c() {
  search qa --prompts domains/qa
  search story_writing --prompts domains/story_writing
  search translation --prompts domains/translation
}
chain_d() {
  search text_to_sql --prompts domains/text_to_sql
  search summarization --prompts domains/summarization
  search rag --prompts domains/rag
}
mkdir -p "$sets"
pids=()
for chain in pooled chain_b chain_c chain_d; do
  $chain > "$sets/$chain.log" 2>&1 &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done
jspec fit-knn --sets "$sets" --out checkpoints/smollm2-135m-instruct/knn-ssd --count 16 --no-anchors pooled
