"""Would SpecEE's predictors exit better if they also read the depth's hidden state? (issue 14, offline)

The predictors read 12 numbers about the 4 candidates (jspec/parts/predictors.py). This script asks
whether the depth-d state itself holds more of the answer to "is this depth's choice final?":

1. The model answers `--count` training prompts greedily, as `jspec train-predictors` does.
2. One teacher-forced pass over each prompt + answer records, at every answer position and every
   depth d from the head's layer on, the candidates' logits, the final-normed state z_d, and the
   full model's log-probabilities of the candidates and of its own token.
3. Per-depth predictors (the shipped shape, 12 -> 512 -> 1) are fitted on 90% of the answers with
   each feature set: the 12 features, and the 12 with z_d's first K principal components (fitted
   on the training split, K in --pca); each for 5 and 30 epochs (the shipped ones: 30).
4. On the held-out 10%, the exit rule is replayed with every depth checked: per threshold, the
   mean layers run, the share of tokens that exit with a token other than the final one, and the
   negative log-likelihood those tokens add under the full model, relative to ar's own NLL on the
   same positions. Each position keeps ar's context (teacher forcing), so a wrong exit does not
   change what follows as it does in decoding: the NLL column is a lower bound of decoding's.

    python benchmarks/probes/specee_features.py --count 256 --output benchmarks/results/2026-11-25_specee-hidden-state-features.jsonl
"""

from __future__ import annotations

import argparse
import json

import jax
import numpy as np

import jspec
from jspec import prompt_sets
from jspec.jsonl import read_prompts
from jspec.parts import heads, shipped
from jspec.training import train_predictors as train
from jspec.training.distill import choose

THRESHOLDS = (0.5, 0.7, 0.8, 0.9, 0.95, 0.97, 0.99)


def replay(p, label, cost, depths, num_layers, ar_nll):
    """The exit rule with every depth checked, per threshold."""
    rows = []
    pos = np.arange(p.shape[1])
    for t in THRESHOLDS:
        fires = p > t
        exited, first = fires.any(0), fires.argmax(0)
        wrong = exited & ~label[first, pos]
        added = np.where(exited, cost[first, pos], 0.0)
        rows.append({"threshold": t, "mean_layers": round(float(np.where(exited, np.asarray(depths)[first],
                                                                         num_layers).mean()), 2),
                     "wrong_exits": round(float(wrong.mean()), 4),
                     "nll_vs_ar": round(float(added.mean() / ar_nll), 4)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--count", type=int, default=256)
    ap.add_argument("--pca", default="8,32", help="principal components of z_d to add (comma-separated)")
    ap.add_argument("--output", required=True)
    args = ap.parse_args()
    model = jspec.load()
    head = str(shipped.find(model, "specee") / "head")  # the head the shipped predictors read
    hp, meta = heads.load(head, model.cfg, model.mesh)
    n, num_layers = meta["exit_layer"], model.cfg.num_layers
    depths = list(range(n, num_layers))
    requests = choose(model, read_prompts(prompt_sets.resolve(prompt_sets.TRAIN_PROMPTS)), args.count, 192, 0)
    data = train.collect(model, hp, n, train.answer(model, requests, head, max_new_tokens=64, batch_size=8),
                         states=True)
    cl, label, in_candidates = data["cand_logits"], data["label"], data["in_candidates"]
    choice = cl.argmax(-1)  # [P, N] the depth's choice, an index into the candidates
    cost = data["final_logp"][None] - np.take_along_axis(data["cand_logp"][None], choice[..., None], -1)[..., 0]
    held = data["sequence"] % 10 == 9
    ar_nll = float(-data["final_logp"][held].mean())
    base = train.feature_matrix(cl)
    sets = {"12": base}
    z = data["z"].astype(np.float32)
    for k in map(int, args.pca.split(",")):
        comps = []
        for zd in z:
            mean = zd[~held].mean(0)
            _, _, vt = np.linalg.svd(zd[~held][:4000] - mean, full_matrices=False)
            comps.append((zd - mean) @ vt[:k].T)
        comps = np.stack(comps)
        sets[f"12+pca{k}"] = np.concatenate([base, comps / comps[:, ~held].std(1, keepdims=True)], -1)
    print(f"{held.sum()} held-out tokens of {len(held)}; final token among the candidates: "
          f"{in_candidates.mean():.3f}; ar NLL on them {ar_nll:.3f}")
    for d in (4, 12, 20, 24, 29):  # how often a depth's choice is final, and what it costs when not
        right = label[d - n]
        print(f"depth {d}: choice final for {right.mean():.3f}; when not, median NLL cost "
              f"{np.median(cost[d - n][~right]):.2f} nats")
    with open(args.output, "w") as f:
        for name, x in sets.items():
            for epochs in (5, 30):
                pp, _ = train.fit(x[:, ~held], label[:, ~held], jax.random.key(0), epochs, progress=False)
                for row in replay(train.scores(pp, x[:, held]), label[:, held], cost[:, held], depths, num_layers,
                                  ar_nll):
                    row = {"features": name, "epochs": epochs, **row}
                    print(json.dumps(row))
                    f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
