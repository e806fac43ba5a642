#!/usr/bin/env bash
# The shipped knn-ssd folder for the default model: search each of the nine domains' sublayer skip
# set and one set on all domains pooled (the baseline), fit the anchors, write the card.
#   bash benchmarks/probes/knn_search_all.sh [TRIALS] [ANCHOR_PROMPTS]
# The objective is measured tokens/s, so the searches run one after another on a quiet machine.
# Rerunning resumes every search from its trial log; a smaller TRIALS finishes them with the
# trials already logged.
set -euo pipefail
cd "$(dirname "$0")/.."
sets=benchmarks/probes/knn_sets
trials=${1:-30}
anchor_prompts=${2:-1000}
search() {
  jspec search-skip --objective measured --trials "$trials" --max-new-tokens 32 \
    --out "$sets/$1.json" "${@:2}" 2> "$sets/$1.log"
}
mkdir -p "$sets"
search coding --prompts train_prompts --category coding --count 4
search writing --prompts train_prompts --category writing --count 4
search math --prompts train_prompts --category math --count 4
for d in translation summarization qa text_to_sql story_writing rag; do
  search "$d" --prompts "domains/$d" --count 4
done
python benchmarks/probes/knn_pooled.py "$sets/pooled_prompts.jsonl"
search pooled --prompts "$sets/pooled_prompts.jsonl" --count 9 --all-buckets
folder=jspec/checkpoints/smollm2-135m-instruct/knn-ssd
jspec fit-knn --sets "$sets" --out "$folder" --count "$anchor_prompts" --no-anchors pooled
python benchmarks/probes/knn_card.py "$folder" "$sets"
