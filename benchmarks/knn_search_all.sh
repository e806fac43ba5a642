#!/usr/bin/env bash
# Search the nine domains' sublayer skip sets and the pooled set for the default model, then fit
# the anchors into checkpoints/smollm2-135m-instruct/knn-ssd/. The objective is the cost model
# (--objective modeled), which other work on a shared machine cannot disturb, so three chains
# run side by side. Rerunning resumes every search from its trial log.
#   bash benchmarks/knn_search_all.sh [SETS_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
sets=${1:-benchmarks/knn_sets}
budget=(--objective modeled --trials 12 --count 2 --max-new-tokens 24)
search() { jspec search-skip "${budget[@]}" --out "$sets/$1.json" "${@:2}"; }
pooled() {
  jspec search-skip --objective modeled --trials 10 --count 9 --max-new-tokens 24 --all-buckets \
    --out "$sets/pooled.json" --prompts benchmarks/knn_pooled_prompts.jsonl
}
chain_b() {
  search coding --prompts train_prompts --category coding
  search writing --prompts train_prompts --category writing
  search math --prompts train_prompts --category math
  search translation --prompts domains/translation
}
chain_c() {
  search qa --prompts domains/qa
  search story_writing --prompts domains/story_writing
  search text_to_sql --prompts domains/text_to_sql
  search summarization --prompts domains/summarization
  search rag --prompts domains/rag
}
mkdir -p "$sets"
pooled > "$sets/pooled.log" 2>&1 &
a=$!
chain_b > "$sets/chain_b.log" 2>&1 &
b=$!
chain_c > "$sets/chain_c.log" 2>&1 &
c=$!
wait $a && wait $b && wait $c
jspec fit-knn --sets "$sets" --out checkpoints/smollm2-135m-instruct/knn-ssd --count 48 --no-anchors pooled
