#!/usr/bin/env bash
# The shipped knn-ssd folder for the default model: search the nine domains' sublayer skip sets,
# take the pooled baseline from them, fit the anchors, write the card.
#   bash benchmarks/knn_search_all.sh [TRIALS]
# The objective is the cost model (--objective modeled), which other work on a shared machine
# cannot disturb, so the searches run side by side. Rerunning resumes every search from its trial
# log; a smaller TRIALS finishes them with the trials already logged (the shipped folder was
# finished that way: the card lists each domain's count).
set -euo pipefail
cd "$(dirname "$0")/.."
sets=benchmarks/knn_sets
trials=${1:-8}
search() {
  jspec search-skip --objective modeled --trials "$trials" --count 2 --max-new-tokens 24 \
    --out "$sets/$1.json" "${@:2}" > "$sets/$1.log" 2>&1
}
mkdir -p "$sets"
search coding --prompts train_prompts --category coding &
search writing --prompts train_prompts --category writing &
search math --prompts train_prompts --category math &
search translation --prompts domains/translation &
search summarization --prompts domains/summarization &
search qa --prompts domains/qa &
search text_to_sql --prompts domains/text_to_sql &
search story_writing --prompts domains/story_writing &
search rag --prompts domains/rag &
wait
python benchmarks/knn_pooled.py "$sets"
folder=checkpoints/smollm2-135m-instruct/knn-ssd
jspec fit-knn --sets "$sets" --out "$folder" --count 16 --no-anchors pooled
python benchmarks/knn_card.py "$folder" "$sets"
