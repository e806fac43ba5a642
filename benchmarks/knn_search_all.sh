#!/usr/bin/env bash
# Search the nine domains' sublayer skip sets and the pooled set for the default model, then fit
# the anchors: checkpoints/smollm2-135m-instruct/knn-ssd/. Two chains run side by side (the
# shared 2-core machine). Rerunning resumes every search from its trial log.
#   bash benchmarks/knn_search_all.sh [SETS_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
sets=${1:-benchmarks/knn_sets}
budget=(--trials 10 --count 2 --max-new-tokens 24)
search() { jspec search-skip "${budget[@]}" --out "$sets/$1.json" "${@:2}"; }
chain_a() {
  search coding --prompts train_prompts --category coding
  search writing --prompts train_prompts --category writing
  search math --prompts train_prompts --category math
  search translation --prompts domains/translation
  search summarization --prompts domains/summarization
}
chain_b() {
  jspec search-skip --trials 8 --count 9 --max-new-tokens 24 --all-buckets --out "$sets/pooled.json" \
    --prompts benchmarks/knn_pooled_prompts.jsonl
  search qa --prompts domains/qa
  search text_to_sql --prompts domains/text_to_sql
  search story_writing --prompts domains/story_writing
  search rag --prompts domains/rag
}
mkdir -p "$sets"
chain_a > "$sets/chain_a.log" 2>&1 &
a=$!
chain_b > "$sets/chain_b.log" 2>&1 &
b=$!
wait $a $b
jspec fit-knn --sets "$sets" --out checkpoints/smollm2-135m-instruct/knn-ssd --count 48 --no-anchors pooled
