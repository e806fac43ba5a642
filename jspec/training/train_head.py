"""Train a draft head (jspec.parts.heads) by self-distillation from the target's own distributions.

The target is frozen: its first N layers turn each training sequence (prompt + the target's own
answer) into layer-N states (computed once, before the first step; for an EAGLE head, all its
layers: the final-normed state of each previous position, beside the token's embedding), the head
maps them to draft logits over its draft vocabulary, and
the loss is the soft cross-entropy to the target's top-k next-token distribution (KL up to the
teacher's constant entropy), renormalised over the draft vocabulary, plus optionally
`ce_weight` x cross-entropy on the answer tokens. Only answer positions count: that is where a
head drafts.

Data: one or more distill-data folders (the model's answers, teacher-forced text), padded to
a common length. The held-out split is by prompt, never by token or row: the rows of `eval_data`
folders when given (and no training row of the same prompts), else the prompts whose seeded hash
falls in `eval_fraction`. Held-out rows give top-1 agreement with the target and the expected
acceptance sum_x min(p(x), q(x)) of one drafted token.

The head starts from the target's layers N .. N+D-1 (jspec.parts.heads.init), or from a saved head
(`init`, its draft vocabulary kept): training a shipped head further on new data.

Optimiser: AdamW with linear warmup, cosine decay to a tenth and global-norm clipping (optax).
With `eval_every`, the held-out agreement is measured every so many steps; the best parameters
are kept and training stops after `patience` measurements without a gain (early stopping). The
saved head is the best one.

Checkpoints (orbax, one folder per step, the latest KEEP kept: parameters, optimiser state and
the early-stopping state) go to OUT.train/ every `save_every` steps and when interrupted;
rerunning the same command resumes from the latest one.
The batch of step s depends only on s and the seed, so a resumed run computes what an
uninterrupted one would.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import shutil
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jspec import files
from jspec.convert import store
from jspec.errors import JspecError
from jspec.model import decoder as M, weights
from jspec.parts import folder, heads
from jspec.training import distill, head_data

log = logging.getLogger("jspec")

KEEP = 2  # checkpoints kept in OUT.train/


@dataclasses.dataclass(frozen=True)
class Recipe:
    kind: str = "eesd"
    exit_layer: int = 6
    head_layers: int = 1
    steps: int = 600
    batch_size: int = 8
    lr: float = 1e-3
    warmup: int = 30
    weight_decay: float = 0.01
    b1: float = 0.9
    b2: float = 0.999
    clip: float = 1.0
    ce_weight: float = 0.0
    draft_vocab: int = 8192
    eval_fraction: float = 0.05
    save_every: int = 100
    eval_every: int = 0  # 0: measure held-out agreement only at the end (no early stopping)
    patience: int = 5
    seed: int = 0
    init: str = ""  # a saved head to start from (its draft vocabulary kept); "": fresh from the target's layers

    def check(self) -> None:
        if self.kind not in heads.KINDS:
            raise JspecError(f"unknown head kind {self.kind!r}; choose one of {', '.join(heads.KINDS)}")
        for name in ("head_layers", "steps", "batch_size", "save_every", "patience"):
            if getattr(self, name) < 1:
                raise JspecError(f"--{name.replace('_', '-')} must be >= 1")
        if not 0 < self.eval_fraction < 1:
            raise JspecError("--eval-fraction must be between 0 and 1")
        positive = all(0 < x < math.inf for x in (self.lr, self.clip))  # NaN fails too
        counts = min(self.warmup, self.draft_vocab, self.eval_every) >= 0
        if not (positive and counts and 0 <= self.ce_weight < math.inf and 0 <= self.weight_decay < math.inf):
            raise JspecError("--lr and --clip must be > 0; --warmup, --draft-vocab, --ce-weight, --weight-decay "
                             "and --eval-every >= 0")
        if not (0 <= self.b1 < 1 and 0 <= self.b2 < 1):
            raise JspecError("--b1 and --b2 must be in [0, 1)")


def evaluate_head(lm, head: str | Path, folders: list, data_folders: int, fraction: float = 0.05, seed: int = 0,
                  batch_size: int = 8, progress: bool = False) -> dict:
    """Held-out metrics of a saved head on the rows `held_out` picks (the same as `train` with
    these folders, fraction and seed); `progress` shows the frozen-states pass, as `train` does."""
    hp, meta = heads.load(head, lm.cfg)
    _, data = head_data.load_data(folders)
    _, rows = head_data.held_out(data, data_folders, fraction, seed)
    data = {k: v[rows] for k, v in data.items()}  # the frozen layers run on the held-out rows only
    arrays = head_data.prepare(data, np.asarray(hp["vocab"]), lm.cfg.vocab_size)
    width = head_data.widths(data)
    arrays.update(head_data.head_inputs(lm.params, lm.cfg, meta["kind"], meta["exit_layer"], data["tokens"], width,
                              2 * batch_size, progress))
    frozen = _frozen(lm.params, hp)
    evaluate = jax.jit(lambda tr, batch: _losses(_forward(tr, frozen, lm.cfg, batch), batch, 0.0)[1])
    trainable = {k: v for k, v in hp.items() if k != "vocab"}
    return {**_evaluate(evaluate, trainable, arrays, np.arange(len(rows)), width, batch_size),
            "held_out_sequences": len(rows), "held_out_tokens": int(data["answer_lens"].sum())}


def _frozen(params, hp: dict) -> dict:
    """What training reads of the target: the LM head's rows of the draft vocabulary, and for an
    EAGLE head the embedding."""
    return {"vocab": hp["vocab"], "lm_head": weights.as_float(heads.draft_params(params, hp)["lm_head"]),
            **({"embed": params["embed"]} if "fuse" in hp else {})}


def _forward(trainable, frozen, cfg, batch):
    """Draft log-probs over the draft vocabulary at the answer positions [B, A, M]."""
    h, prompt_lens = batch["hidden"], batch["prompt_lens"]
    if "fuse" in trainable:
        h = heads.fuse_input(frozen, trainable, batch["tokens"], h)
    b, length = h.shape[:2]
    hp = {**trainable, "vocab": frozen["vocab"]}
    x, _ = heads.block(cfg, hp, h, None, heads.empty_kv(cfg, hp, b, length))
    answer = batch["top_logp"].shape[1]
    at = jnp.minimum(prompt_lens[:, None] - 1 + jnp.arange(answer)[None], length - 1)
    x = jnp.take_along_axis(x, at[:, :, None], axis=1)
    return jax.nn.log_softmax(M.linear(x, frozen["lm_head"], jnp.float32), axis=-1)


def _losses(logq, batch, ce_weight: float):
    """Per-batch mean loss and metrics over valid answer positions."""
    valid = jnp.arange(logq.shape[1])[None] < batch["answer_lens"][:, None]  # [B, A]
    p = jnp.exp(batch["top_logp"])  # [B, A, k] true probabilities of the teacher's top k
    in_sub = batch["top_sub"] >= 0
    logq_k = jnp.take_along_axis(logq, jnp.maximum(batch["top_sub"], 0), axis=-1)
    p_sub = jnp.where(in_sub, p, 0.0)
    soft_ce = -jnp.sum(p_sub / jnp.maximum(p_sub.sum(-1, keepdims=True), 1e-9) * logq_k, axis=-1)
    gen = batch["gen_sub"]
    ce = jnp.where(gen >= 0, -jnp.take_along_axis(logq, jnp.maximum(gen, 0)[..., None], axis=-1)[..., 0], 0.0)
    per_pos = soft_ce + ce_weight * ce
    top1 = jnp.argmax(logq, axis=-1)
    agree = (top1 == batch["top_sub"][..., 0]) & in_sub[..., 0]
    accept = jnp.sum(jnp.minimum(p, jnp.where(in_sub, jnp.exp(logq_k), 0.0)), axis=-1)
    n = jnp.maximum(valid.sum(), 1)
    mean = lambda x: jnp.sum(jnp.where(valid, x, 0.0)) / n
    return mean(per_pos), {"loss": mean(per_pos), "agreement": mean(agree.astype(jnp.float32)),
                           "expected_acceptance": mean(accept), "vocab_coverage": mean(in_sub[..., 0].astype(jnp.float32)),
                           "positions": valid.sum()}


def train(lm, data_dirs, out, recipe: Recipe, eval_dirs=(), progress: bool = True,
          on_step=None) -> tuple[Path, dict]:
    """Train a head on `lm` (jspec.api.Model) from distill-data folders; save it to `out`.

    `data_dirs`: a folder or a list of them; `eval_dirs`: held-out folders (else a split of the
    data by prompt). `on_step(step, metrics)` runs after each step (tests interrupt training
    through it). Returns (the head folder, the summary written into its head.json).
    """
    from tqdm import tqdm

    recipe.check()
    if recipe.warmup >= recipe.steps:  # allowed: a step or two to try a setup, or to go on from --init unchanged
        log.warning(f"--warmup {recipe.warmup} >= --steps {recipe.steps}: the learning rate never reaches "
                    f"--lr {recipe.lr:g}")
    cfg, params = lm.cfg, lm.params
    if recipe.exit_layer not in heads.exit_layers(recipe.kind, cfg):
        raise JspecError(f"an eagle head reads the last layer's state: --exit-layer {cfg.num_layers} (or none), "
                         f"not {recipe.exit_layer}" if recipe.kind == "eagle" else
                         f"--exit-layer must be between 1 and {cfg.num_layers - 1}, got {recipe.exit_layer}")
    data_dirs = [data_dirs] if isinstance(data_dirs, (str, Path)) else list(data_dirs)
    folders = [str(Path(f).absolute()) for f in [*data_dirs, *eval_dirs]]
    ckpt_dir = Path(str(Path(out).absolute()) + ".train")
    info_path = ckpt_dir / "recipe.json"
    # The head format too: a run checkpointed before w_gate_up was interleaved (format 3) holds its
    # rows, and its optimizer's, in the old order, and is refused rather than resumed.
    info = {"recipe": dataclasses.asdict(recipe), "data": folders[:len(data_dirs)],
            "eval_data": folders[len(data_dirs):], "head_format": heads.FOLDER.format}
    steps_saved = saved_steps(ckpt_dir)
    saved = json.loads(info_path.read_text()) if steps_saved and info_path.exists() else {}
    if steps_saved and any(saved.get(k) != info[k] for k in info):  # before the long pass below
        raise JspecError(f"{ckpt_dir} holds a run with other settings; remove it or use another --out")
    data_metas, data = head_data.load_data(folders)
    if data["top_ids"].max() >= cfg.vocab_size:
        raise JspecError("the data was made with another model's vocabulary")
    n = len(data["tokens"])
    train_rows, eval_rows = head_data.held_out(data, len(data_dirs), recipe.eval_fraction, recipe.seed)
    if len(train_rows) < recipe.batch_size or not len(eval_rows):
        raise JspecError(f"the data has {len(train_rows)} training and {len(eval_rows)} held-out sequences: "
                         f"too few for a batch of {recipe.batch_size} and a held-out set (more prompts in "
                         "distill-data --count, a larger --eval-fraction, or --eval-data DIR)")
    started_from = None
    if recipe.init:
        hp, started_from = start_head(lm, recipe)
        vocab = np.asarray(hp["vocab"])
    else:
        vocab = head_data.draft_vocabulary(data["tokens"][train_rows], data["prompt_lens"][train_rows],
                                 data["answer_lens"][train_rows], cfg.vocab_size, recipe.draft_vocab)
        hp = heads.init(params, cfg, recipe.kind, recipe.exit_layer, vocab, recipe.head_layers)
    arrays = head_data.prepare(data, vocab, cfg.vocab_size)
    width = head_data.widths(data)
    arrays.update(head_data.head_inputs(params, cfg, recipe.kind, recipe.exit_layer, data["tokens"], width,
                              2 * recipe.batch_size, progress))
    frozen = _frozen(params, hp)
    trainable = {k: v for k, v in hp.items() if k != "vocab"}

    schedule = optax.warmup_cosine_decay_schedule(0.0, recipe.lr, recipe.warmup, max(recipe.steps, recipe.warmup + 1),
                                                  end_value=recipe.lr / 10)
    opt = optax.chain(optax.clip_by_global_norm(recipe.clip),
                      optax.adamw(schedule, b1=recipe.b1, b2=recipe.b2, weight_decay=recipe.weight_decay))

    def loss_fn(tr, batch):
        return _losses(_forward(tr, frozen, cfg, batch), batch, recipe.ce_weight)

    @jax.jit
    def step_fn(tr, opt_state, batch):
        (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(tr, batch)
        updates, opt_state = opt.update(grads, opt_state, tr)
        return optax.apply_updates(tr, updates), opt_state, metrics

    evaluate = jax.jit(lambda tr, batch: loss_fn(tr, batch)[1])

    # best_*: early stopping's state, checkpointed with the rest so that a resumed run stops where
    # an uninterrupted one would.
    state = {"params": trainable, "opt_state": opt.init(trainable), "best_params": trainable,
             "best_agreement": jnp.float32(-1), "best_step": jnp.int32(0), "stale": jnp.int32(0),
             "measured_step": jnp.int32(0)}
    info["sequences"] = n
    start, wall = 0, 0.0
    if steps_saved:
        start = steps_saved[-1]
        # Onto the devices of the fresh state (the model's), whatever the checkpoint was saved from.
        state = store.restore(ckpt_dir / str(start), state, jax.tree.map(lambda x: x.sharding, state))
        wall = saved.get("wall_seconds", 0.0)
    ckpt_dir.mkdir(parents=True, exist_ok=True)

    def save(step: int, seconds: float) -> None:
        store.save_params(ckpt_dir / str(step), state)
        for old in saved_steps(ckpt_dir)[:-KEEP]:
            shutil.rmtree(ckpt_dir / str(old))
        files.write_text(info_path, json.dumps({**info, "wall_seconds": seconds}))  # whole, or the old one

    per_epoch = len(train_rows) // recipe.batch_size

    def batch_at(step: int) -> dict:
        # An epoch's shuffled rows, grouped by width so that a batch pads little, in batches taken
        # in a shuffled order.
        epoch, i = divmod(step, per_epoch)
        rng = np.random.default_rng([recipe.seed, epoch])
        perm = rng.permutation(train_rows)
        perm = perm[np.argsort(width[perm], kind="stable")]
        rows = perm[rng.permutation(per_epoch)[i] * recipe.batch_size:][:recipe.batch_size]
        return head_data.batch(arrays, rows, int(width[rows].max()))

    def measure(step: int) -> None:
        if not recipe.eval_every or int(state["measured_step"]) == step:
            return
        agreement = _evaluate(evaluate, state["params"], arrays, eval_rows, width, recipe.batch_size)["agreement"]
        if agreement > float(state["best_agreement"]):
            state.update(best_params=state["params"], best_agreement=jnp.float32(agreement),
                         best_step=jnp.int32(step), stale=jnp.int32(0))
        else:
            state["stale"] = state["stale"] + 1
        state["measured_step"] = jnp.int32(step)

    stopped = lambda: recipe.eval_every and int(state["stale"]) >= recipe.patience
    t0, step = time.perf_counter(), start
    if start and start % max(recipe.eval_every, 1) == 0:
        measure(start)  # an interrupt may have come between the step and its measurement
    try:
        with tqdm(total=recipe.steps, initial=start, unit="step", disable=not progress, dynamic_ncols=True) as bar:
            while step < recipe.steps and not stopped():
                state["params"], state["opt_state"], metrics = step_fn(state["params"], state["opt_state"],
                                                                       batch_at(step))
                step += 1
                if on_step is not None:
                    on_step(step, metrics)
                if recipe.eval_every and step % recipe.eval_every == 0:
                    measure(step)
                    bar.set_postfix(held_out=f"{float(state['best_agreement']):.3f}@{int(state['best_step'])}")
                elif step % 10 == 0:
                    bar.set_postfix(loss=f"{float(metrics['loss']):.3f}", agree=f"{float(metrics['agreement']):.3f}")
                bar.update(1)
                if step % recipe.save_every == 0 or step == recipe.steps or stopped():
                    save(step, wall + time.perf_counter() - t0)
        if not stopped():
            measure(step)
    except KeyboardInterrupt:
        if step > max(saved_steps(ckpt_dir), default=0):
            save(step, wall + time.perf_counter() - t0)
        raise
    wall += time.perf_counter() - t0

    final = state["best_params"] if recipe.eval_every else state["params"]
    final_metrics = _evaluate(evaluate, final, arrays, eval_rows, width, recipe.batch_size)
    summary = {"steps": step, "best_step": int(state["best_step"]) if recipe.eval_every else step,
               "wall_seconds": round(wall, 1), "train_sequences": len(train_rows),
               "train_tokens": int(data["answer_lens"][train_rows].sum()), "held_out_sequences": len(eval_rows),
               "held_out_tokens": int(data["answer_lens"][eval_rows].sum()),
               **{k: round(v, 4) for k, v in final_metrics.items()}, "recipe": dataclasses.asdict(recipe),
               "data": [{"path": f, **m, "sequences": int((data["folder"] == i).sum()), "held_out": i >= len(data_dirs)}
                        for i, (f, m) in enumerate(zip(folders, data_metas))]}
    if started_from is not None:  # the head's lineage travels with it: the --init head may be replaced later
        summary["started_from"] = started_from
    meta = {"kind": recipe.kind, "exit_layer": recipe.exit_layer, "model": folder.fingerprint(cfg),
            "model_name": lm.name, "draft_vocab": int(len(vocab)), "training": summary}
    path = heads.save(out, {**final, "vocab": hp["vocab"]}, meta)
    return path, summary


def start_head(lm, recipe: Recipe) -> tuple[dict, dict]:
    """(the parameters, the training summary) of `recipe.init`, a saved head of the recipe's kind
    and exit layer, grown to the recipe's depth if it has fewer layers (heads.grow)."""
    hp, meta = heads.load(recipe.init, lm.cfg, lm.mesh)
    have = (meta["kind"], meta["exit_layer"], len(hp["layers"]))
    if have[:2] != (recipe.kind, recipe.exit_layer) or have[2] > recipe.head_layers:
        raise JspecError(f"--init {recipe.init} is a head of kind {have[0]} at exit layer {have[1]} with {have[2]} "
                         "layer(s); ask for the same --kind and --exit-layer, and at least its --head-layers")
    training = meta.get("training", {})
    if not isinstance(training, dict):
        raise JspecError(f"--init {recipe.init} is damaged: its head.json's \"training\" must be an object")
    return heads.grow(lm.params, lm.cfg, recipe.kind, recipe.exit_layer, hp, recipe.head_layers), training


def saved_steps(ckpt_dir: Path) -> list[int]:
    """The steps checkpointed in OUT.train/, oldest first. Each is a complete orbax folder named
    by its step: orbax writes it under a temporary name and renames it when done."""
    return sorted(int(p.name) for p in ckpt_dir.glob("*") if p.name.isdigit())


def _evaluate(evaluate, tr, arrays: dict, rows: np.ndarray, width: np.ndarray, batch_size: int) -> dict:
    """Position-weighted held-out metrics."""
    totals, count = {"loss": 0.0, "agreement": 0.0, "expected_acceptance": 0.0, "vocab_coverage": 0.0}, 0
    rows = rows[np.argsort(width[rows], kind="stable")]
    for start in range(0, len(rows), batch_size):
        chunk = rows[start:start + batch_size]
        batch = head_data.batch(arrays, distill.pad_rows(chunk, batch_size), int(width[chunk].max()))
        batch["answer_lens"] = batch["answer_lens"].at[len(chunk):].set(0)  # padding rows do not count
        m = jax.device_get(evaluate(tr, batch))
        positions = int(m["positions"])
        for k in totals:
            totals[k] += float(m[k]) * positions
        count += positions
    return {k: v / max(count, 1) for k, v in totals.items()}
