"""Training SpecEE's exit predictors on the model's own full-depth runs (`jspec train-predictors`).

1. The model answers training prompts greedily (any lossless method gives the same tokens).
2. One teacher-forced pass over each prompt + answer records, at every answer position and every
   depth d from the head's layer N to L - 1, the 4 candidates' logits (the head's top 4 from the
   depth-N state) and whether the depth's choice (the candidates' argmax) is the final token.
3. One MLP per depth is fitted with optax (BCE, Adam 1e-3, batches of 1024) on 90% of the
   answers; the other 10% give held-out accuracy and precision. Labels of positions of one answer
   are correlated, so the split is by answer, not by position.
4. The offline schedule: the depths where, on the training answers with every depth checked, at
   least 2% of the tokens would first exit (at most 8 of them, the most frequent).

On the shortest answers the full-vocabulary argmax at each depth is recorded too, to compare the paper's rule
with the candidates' argmax (docs/methods.md): it costs a whole LM head per depth and position.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jspec.batching import batches, prompt_bucket
from jspec.errors import JspecError
from jspec.model import decoder as M, weights
from jspec.parts import folder, heads, predictors

SCHEDULE_SHARE = 0.02
SCHEDULE_MAX = 8
FULL_RULE_SEQUENCES = 16


@functools.partial(jax.jit, static_argnames=("cfg", "exit_layer", "full", "states"))
def _depth_arrays(params, hp, tokens, *, cfg, exit_layer: int, full: bool, states: bool):
    """tokens [B, T] -> candidate logits [P, B, T, C], candidates [B, T, C], final tokens [B, T],
    when `full` each depth's full-vocabulary argmax [P, B, T] (P = L - exit_layer depths), and when
    `states` each depth's final-normed state z [P, B, T, D] (float16) with the full model's
    log-probs of the candidates [B, T, C] and of its own token [B, T]."""
    b, t = tokens.shape
    h, cache = M.run_layers(params, cfg, M.embed(params, tokens), None, M.KVCache.zeros(cfg, b, t), range(exit_layer))
    x, _ = heads.block(cfg, hp, h, None, heads.empty_kv(cfg, hp, b, t))
    _, idx = jax.lax.top_k(M.linear(x, hp["lm_head"], jnp.float32), predictors.CANDIDATES)
    rows = weights.as_float(weights.take_rows(hp["lm_head"], idx))  # [B, T, C, D]
    cand_logits, argmaxes, zs = [], [], []
    for d in range(exit_layer, cfg.num_layers):
        z = M.rms_norm(h, params["final_norm"], cfg.rms_norm_eps)
        cand_logits.append(jnp.einsum("btd,btcd->btc", z, rows))
        if full:
            argmaxes.append(jnp.argmax(M.logits(params, cfg, h), axis=-1).astype(jnp.int32))
        if states:
            zs.append(z.astype(jnp.float16))  # 26 depths x 576 floats a position: half the memory
        h, cache = M.run_layers(params, cfg, h, None, cache, [d])
    logits = M.logits(params, cfg, h)
    cand = hp["vocab"][idx]
    final = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    out = (jnp.stack(cand_logits), cand, final, jnp.stack(argmaxes) if full else None)
    if not states:
        return out + (None, None, None)
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return out + (jnp.stack(zs), jnp.take_along_axis(logp, cand, -1), logp.max(-1))


def collect(model, hp: dict, exit_layer: int, sequences: list[tuple[list[int], list[int]]], batch_size: int = 8,
            progress: bool = True, states: bool = False) -> dict:
    """Per answer position (the position whose next token is an answer token), for every depth:
    cand_logits [P, N, C], label [P, N] (the candidates' argmax is the final token), the sequence
    each sample came from [N], and on the first sequences the full-vocabulary rule's labels; with
    `states`, also z [P, N, D], cand_logp [N, C] and final_logp [N] (`_depth_arrays`)."""
    from tqdm import tqdm

    cfg = model.cfg
    hp = {**heads.draft_params(model.params, hp)}
    out = {"cand_logits": [], "label": [], "in_candidates": [], "sequence": [], "full_label": [],
           "z": [], "cand_logp": [], "final_logp": []}
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i][0]) + len(sequences[i][1]))
    for start in tqdm(range(0, len(order), batch_size), desc="full-depth runs", unit="batch",
                      disable=not progress, dynamic_ncols=True):
        group = order[start:start + batch_size]
        t = prompt_bucket(max(len(sequences[i][0]) + len(sequences[i][1]) for i in group))
        tokens = np.zeros((batch_size, t), np.int32)
        for row, i in enumerate(group):
            ids = sequences[i][0] + sequences[i][1]
            tokens[row, :len(ids)] = ids
        full = start < FULL_RULE_SEQUENCES  # the shortest answers: one more compile, not one per bucket
        cl, cand, final, argmaxes, z, cand_logp, final_logp = jax.device_get(_depth_arrays(
            model.params, hp, jnp.asarray(tokens), cfg=cfg, exit_layer=exit_layer, full=full, states=states))
        for row, i in enumerate(group):
            prompt, answer = sequences[i]
            span = slice(len(prompt) - 1, len(prompt) + len(answer) - 1)
            choice = np.take_along_axis(cand[row, span][None], cl[:, row, span].argmax(-1)[..., None], -1)[..., 0]
            out["cand_logits"].append(cl[:, row, span])
            out["label"].append(choice == final[row, span][None])
            out["in_candidates"].append((cand[row, span] == final[row, span][:, None]).any(-1))
            out["sequence"].append(np.full(span.stop - span.start, i))
            if full:
                out["full_label"].append(argmaxes[:, row, span] == final[row, span][None])
            if states:
                out["z"].append(z[:, row, span])
                out["cand_logp"].append(cand_logp[row, span])
                out["final_logp"].append(final_logp[row, span])
    cat = lambda xs, axis: np.concatenate(xs, axis=axis) if xs else None
    depth_major = ("cand_logits", "label", "full_label", "z")
    return {k: cat(v, 1 if k in depth_major else 0) for k, v in out.items()}


def feature_matrix(cand_logits: np.ndarray) -> np.ndarray:
    """[P, N, C] candidate logits -> [P, N, 12] features, the change taken against the previous depth."""
    prev = jnp.zeros(cand_logits.shape[1:], jnp.float32)
    rows = []
    for cl in cand_logits:
        x, prev = predictors.features(jnp.asarray(cl), prev)
        rows.append(x)
    return np.asarray(jnp.stack(rows))


def fit(x: np.ndarray, y: np.ndarray, key, epochs: int, batch: int = 1024, lr: float = 1e-3, progress: bool = True):
    """Fit the P predictors at once on x [P, N, F] (F = 12 in decoding), y [P, N]; returns (params,
    loss per step)."""
    from tqdm import tqdm

    pp = predictors.init(key, x.shape[0], x.shape[-1])
    opt = optax.adam(lr)
    opt_state = opt.init(pp)
    x, y = jnp.asarray(x), jnp.asarray(y, jnp.float32)
    count = x.shape[1]
    index = jnp.arange(x.shape[0])

    def loss_fn(pp, xb, yb):
        logits = jax.vmap(lambda i, xi: predictors.logit(pp, i, xi))(index, xb)
        return jnp.mean(optax.sigmoid_binary_cross_entropy(logits, yb))

    @jax.jit
    def step(pp, opt_state, rows):
        loss, grads = jax.value_and_grad(loss_fn)(pp, x[:, rows], y[:, rows])
        updates, opt_state = opt.update(grads, opt_state, pp)
        return optax.apply_updates(pp, updates), opt_state, loss

    per_epoch = max(1, -(-count // batch))
    losses = []
    rng = np.random.default_rng(int(jax.random.randint(key, (), 0, 2 ** 31 - 1)))
    with tqdm(total=epochs * per_epoch, desc="predictors", unit="step", disable=not progress,
              dynamic_ncols=True) as bar:
        for _ in range(epochs):
            perm = rng.permutation(count)
            for j in range(per_epoch):
                rows = perm[j * batch:(j + 1) * batch]
                if len(rows) < batch:  # one shape, one compile: the last batch wraps around
                    rows = np.concatenate([rows, perm[:batch - len(rows)]])[:batch]
                pp, opt_state, loss = step(pp, opt_state, jnp.asarray(rows))
                losses.append(float(loss))
                bar.set_postfix(loss=f"{losses[-1]:.4f}", refresh=False)
                bar.update()
    return pp, losses


def scores(pp: dict, x: np.ndarray) -> np.ndarray:
    """[P, N] exit probabilities."""
    return np.asarray(jax.vmap(lambda i, xi: predictors.score(pp, i, xi))(jnp.arange(x.shape[0]), jnp.asarray(x)))


def metrics(p: np.ndarray, y: np.ndarray, depths: list[int]) -> list[dict]:
    """Held-out accuracy and precision at 0.5 per depth, with the label's base rate."""
    out = []
    for d, pd, yd in zip(depths, p > 0.5, y):
        said = int(pd.sum())
        out.append({"depth": d, "accuracy": round(float((pd == yd).mean()), 4),
                    "precision": round(float((pd & yd).sum() / said), 4) if said else None,
                    "exit_rate": round(float(pd.mean()), 4), "label_rate": round(float(yd.mean()), 4)})
    return out


def first_exits(p: np.ndarray, depths: list[int], num_layers: int, threshold: float = 0.5) -> np.ndarray:
    """Each token's first depth whose predictor says > threshold (num_layers when none does) [N]."""
    fires = p > threshold
    return np.where(fires.any(0), np.asarray(depths)[fires.argmax(0)], num_layers)


def schedule(exits: np.ndarray, depths: list[int]) -> list[int]:
    counts = {d: int((exits == d).sum()) for d in depths}
    frequent = [d for d in depths if counts[d] >= SCHEDULE_SHARE * len(exits)]
    return sorted(sorted(frequent, key=lambda d: -counts[d])[:SCHEDULE_MAX])


def train(model, head_path: str, head_kind: str, sequences, *, epochs: int, seed: int = 0, batch_size: int = 8,
          progress: bool = True) -> tuple[dict, dict]:
    """(predictor params, meta for predictors.save) from (prompt ids, answer ids) pairs."""
    hp, head_meta = heads.load(head_path, model.cfg, model.mesh)
    if head_meta["kind"] != head_kind:
        raise JspecError(f"head {head_path} is of kind {head_meta['kind']}, not {head_kind}")
    n, num_layers = head_meta["exit_layer"], model.cfg.num_layers
    depths = list(range(n, num_layers))
    t0 = time.perf_counter()
    data = collect(model, hp, n, sequences, batch_size, progress)
    if data["label"] is None or data["label"].shape[1] < 2:
        raise JspecError("too few answer tokens to train predictors on")
    x, y = feature_matrix(data["cand_logits"]), data["label"]
    held = data["sequence"] % 10 == 9
    if not held.any() or held.all():
        held = np.arange(len(held)) % 10 == 9
    pp, losses = fit(x[:, ~held], y[:, ~held], jax.random.key(seed), epochs, progress=progress)
    p = scores(pp, x)
    exits = first_exits(p[:, ~held], depths, num_layers)
    oracle = np.where(y.any(0), np.asarray(depths)[y.argmax(0)], num_layers)
    summary = {
        "answers": len(sequences), "samples_per_depth": int(y.shape[1]), "held_out_samples": int(held.sum()),
        "epochs": epochs, "steps": len(losses), "first_loss": round(losses[0], 4), "final_loss": round(losses[-1], 4),
        "wall_seconds": round(time.perf_counter() - t0, 1),
        "held_out": metrics(p[:, held], y[:, held], depths),
        "final_in_candidates": round(float(data["in_candidates"].mean()), 4),
        "mean_layers_at_0.5": round(float(exits.mean()), 3),
        "oracle_mean_layers": round(float(oracle.mean()), 3),
        "choice_rule_right": {"candidates": [round(float(r), 4) for r in y.mean(1)],
                              "full": ([round(float(r), 4) for r in data["full_label"].mean(1)]
                                       if data["full_label"] is not None else None)},
    }
    meta = {"model": folder.fingerprint(model.cfg), "model_name": model.name,
            "head": {"kind": head_kind, "exit_layer": n}, "depths": depths,
            "schedule": schedule(exits, depths), "training": summary}
    return pp, {**meta, "losses": [round(v, 4) for v in losses[:: max(1, len(losses) // 50)]]}


def answer(model, requests: list, head: str, *, max_new_tokens: int, batch_size: int,
           progress: bool = True) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, answer ids) of the model's greedy answers to `requests` (empty answers left out)."""
    from tqdm import tqdm

    # The head's own method decodes the same greedy tokens as ar, faster.
    records = model.stream(requests, heads.read_meta(head)["kind"], head=str(head), max_new_tokens=max_new_tokens,
                           batch_size=batch_size)
    answers = [r["token_ids"] for r in tqdm(records, total=len(requests), desc="answers", unit="prompt",
                                            disable=not progress, dynamic_ncols=True)]
    ran = [r for batch in batches(requests, batch_size) for r in batch]
    return [(r.token_ids, a) for r, a in zip(ran, answers) if a]


def make(model, prompts: list[dict], out, *, head: str | None = None, count: int = 256, max_prompt_tokens: int = 192,
         max_new_tokens: int = 64, epochs: int = 30, batch_size: int = 8, seed: int = 0, progress: bool = True):
    """Answer `count` of `prompts` greedily, train predictors over `head` (default: the Kangaroo head
    shipped for the default model), save them to `out`; returns (path, training summary)."""
    from jspec import methods
    from jspec.training.distill import choose

    if min(count, max_new_tokens, epochs, batch_size) < 1:
        raise JspecError("--count, --max-new-tokens, --epochs and --batch-size must all be >= 1")
    head = head or methods.shipped(model, "kangaroo")
    if head is None:
        raise JspecError("train-predictors needs --head PATH (a Kangaroo or EESD head): heads ship only for "
                         "the default model")
    kind = heads.read_meta(head)["kind"]
    if kind == "eagle":
        raise JspecError("SpecEE's candidates come from a head at a shallow layer of the forward: give a Kangaroo "
                         "or EESD head, not an eagle head")
    requests = choose(model, prompts, count, max_prompt_tokens, seed)
    t0 = time.perf_counter()
    sequences = answer(model, requests, head, max_new_tokens=max_new_tokens, batch_size=batch_size, progress=progress)
    answer_seconds = time.perf_counter() - t0
    pp, meta = train(model, str(head), kind, sequences, epochs=epochs, seed=seed, batch_size=batch_size,
                     progress=progress)
    meta["training"].update(answer_seconds=round(answer_seconds, 1), prompts=len(requests),
                            max_new_tokens=max_new_tokens, seed=seed)
    return predictors.save(out, pp, meta, head), meta["training"]
