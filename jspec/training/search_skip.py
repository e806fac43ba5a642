"""Search one domain's sublayer skip set by Bayesian optimisation (`jspec search-skip`).

    jspec search-skip --prompts domains/qa --out sets/qa.json --trials 40
    jspec search-skip --prompts train_prompts --category math --out sets/math.json

Variables: 2L binary choices, skip layer i's attention / MLP sublayer. Each trial decodes a few
of the domain's prompts greedily with that set (the knn-ssd drafter with the one set, batch 1,
its defaults: up to 12 drafts, stop below 0.8 confidence), all of one prompt bucket so the whole
search compiles one program (a set is data). Objective (`--objective`): `measured`, the
tokens/s of those runs; or `modeled`, tokens per unit of a cost model (`modeled_speed`) fed the
runs' own rounds and drafts, which a machine shared with other work cannot disturb. The sampler
is Optuna's TPE (optional extra `knn`), warm-started with SWIFT's starting point (every other
layer of the middle half) and, for the default model, the shipped layer-skip set: each as whole
layers, attention only and MLP only.

Every trial is appended (fsynced) to OUT.trials.jsonl, after its first line, the search's header
(written whole: a temporary name, then renamed); rerunning the same command resumes from it: the
logged trials are told to a new sampler and only the rest run, and a torn last line (a run killed
while appending it) is cut off and its trial run again. OUT is written, whole, when the last
trial is done. Progress and the best set so far go to stderr.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path

import numpy as np

from jspec import files, prompt_sets
from jspec.errors import JspecError
from jspec.parts import folder, knn, shipped

LOG_SUFFIX = ".trials.jsonl"
STARTUP = 4  # random trials before TPE models the rest (after the warm starts): budgets here are small


def names(num_layers: int) -> list[str]:
    return [f"attention_{i}" for i in range(num_layers)] + [f"mlp_{i}" for i in range(num_layers)]


def to_set(name: str, params: dict, num_layers: int) -> knn.SkipSet:
    return knn.SkipSet(name, tuple(i for i in range(num_layers) if params[f"attention_{i}"]),
                       tuple(i for i in range(num_layers) if params[f"mlp_{i}"]))


def to_params(s: knn.SkipSet, num_layers: int) -> dict:
    return {**{f"attention_{i}": int(i in s.attention) for i in range(num_layers)},
            **{f"mlp_{i}": int(i in s.mlp) for i in range(num_layers)}}


def domain_prompts(source, category: str | None = None) -> list[dict]:
    """{"id", "prompt"} of a prompts file or shipped set, those of `category` only when given."""
    rows = []
    for n, line in enumerate(prompt_sets.read_text(prompt_sets.resolve(source)).split("\n"), 1):
        if line.strip():
            try:  # split on newlines only: prompts may hold other line separators (U+2028)
                obj = json.loads(line)
            except ValueError as e:
                raise JspecError(f"{source}, line {n}: not JSON ({e})") from None
            if category is None or obj.get("category") == category:
                rows.append({"id": obj.get("id", len(rows)), "prompt": obj.get("prompt") or obj.get("messages")})
    if not rows:
        raise JspecError(f"no prompts of category {category!r} in {source}" if category else f"{source} has no prompts")
    return rows


def pick(model, prompts: list[dict], count: int, seed: int, max_tokens: int, one_bucket: bool = True):
    """`count` requests of one prompt bucket (so one compile): of a shuffled sample, the bucket
    holding the median length, or the nearest one with enough prompts. Without one_bucket, the
    first `count` of the sample."""
    from jspec.batching import prompt_bucket

    rows = list(prompts)
    random.Random(seed).shuffle(rows)
    requests = [r for r in model.requests(rows[:max(8 * count, 64)]) if len(r.token_ids) <= max_tokens]
    if not one_bucket:
        return requests[:count]
    by_bucket: dict[int, list] = {}
    for r in requests:
        by_bucket.setdefault(prompt_bucket(len(r.token_ids)), []).append(r)
    full = [b for b, rs in by_bucket.items() if len(rs) >= count]
    if not full:
        raise JspecError(f"fewer than {count} prompts of at most {max_tokens} tokens share a prompt bucket")
    median = prompt_bucket(int(np.median([len(r.token_ids) for r in requests])))
    bucket = min(full, key=lambda b: abs(b - median))
    return by_bucket[bucket][:count]


# A forward over R positions of the default model, in decode steps (docs/design.md, "Few rows":
# the native kernel, medians of three runs on this 2-core CPU).
FORWARD_COST = ((1, 1.0), (2, 1.25), (5, 1.40), (8, 1.76), (16, 2.85))


def forward_cost(positions: int) -> float:
    rows, cost = zip(*FORWARD_COST)
    return float(np.interp(positions, rows, cost, right=cost[-1] * positions / rows[-1]))


def draft_step_cost(cfg, s: knn.SkipSet) -> float:
    """One draft step in decode steps: the share of the weights it reads (a decode step is memory
    bound), the LM head included."""
    attention = cfg.hidden_size * (cfg.num_kv_heads * (cfg.group_size + 2) + cfg.num_heads) * cfg.head_dim
    mlp = 3 * cfg.hidden_size * cfg.intermediate_size
    head = cfg.vocab_size * cfg.hidden_size
    total = cfg.num_layers * (attention + mlp) + head
    return (total - len(s.attention) * attention - len(s.mlp) * mlp) / total


def modeled_speed(cfg, s: knn.SkipSet, max_draft: int, new: int, rounds: int, drafted: int) -> float:
    """Tokens per decode step's time: the prefill round costs nothing extra over ar's, every other
    round one verification of max_draft + 1 positions, every draft step its share of the weights."""
    return new / (1 + (rounds - 1) * forward_cost(max_draft + 1) + drafted * draft_step_cost(cfg, s))


class Measure:
    """Greedy knn-ssd decoding with one skip set on fixed requests (batch 1): its measured tokens/s
    or its modeled speed, and both, its mean accepted tokens and whether it matched ar, as extras."""

    def __init__(self, model, requests, max_new_tokens: int, objective: str = "measured"):
        import jax

        from jspec.controllers import make_controller
        from jspec.drafters.knn_ssd import KnnSsd
        from jspec.engine.sampling import Sampling
        from jspec.methods import knn_ssd

        self.model, self.requests, self.max_new, self.objective = model, requests, max_new_tokens, objective
        self.drafter = KnnSsd(max_draft=knn_ssd.MAX_DRAFT, domains=("search",))
        self.controller = make_controller("confidence", threshold=knn_ssd.THRESHOLD)
        self.sampling, self.key = Sampling(), jax.random.key(0)
        self.anchor = np.ones((1, model.cfg.hidden_size), np.float32)
        self.ar, records = self._run(None)
        self.ar_tokens_per_second = sum(r["new_tokens"] for r in records) / sum(r["seconds"] for r in records)

    def _run(self, s: knn.SkipSet | None):
        """Each request's steady run: the first run of a program (ar's, and the first trial's, on each
        prompt bucket) pays its first execution, which would read as a slower set."""
        from jspec.engine.programs import steady_run
        from jspec.drafters.none import NoDraft

        cfg = self.model.cfg
        if s is None:
            plan = (NoDraft(), (), self.controller)
        else:
            table = knn.Knn(folder.fingerprint(cfg), [s], self.anchor, np.zeros(1, np.int32))
            plan = (self.drafter, table.dparams(cfg), self.controller)
        records = [rec for r in self.requests for rec in steady_run(
            self.model, lambda r=r: self.model.run_batch([r], 1, self.max_new, self.sampling, self.key, plan))]
        return [r["token_ids"] for r in records], records

    def __call__(self, s: knn.SkipSet) -> tuple[float, dict]:
        tokens, records = self._run(s)
        new = sum(r["new_tokens"] for r in records)
        rounds = sum(r["stats"]["rounds"] for r in records)
        drafted = sum(r["stats"]["drafted"] for r in records)
        measured = new / sum(r["seconds"] for r in records)
        modeled = modeled_speed(self.model.cfg, s, self.drafter.max_draft, new, rounds, drafted)
        extra = {"measured_tokens_per_second": round(measured, 3), "modeled_speed": round(modeled, 4),
                 "ar_tokens_per_second": round(self.ar_tokens_per_second, 3),
                 "mean_accepted_tokens": round(new / rounds, 4), "same_as_ar": tokens == self.ar}
        return (measured if self.objective == "measured" else modeled), extra


class OptunaProposer:
    """Optuna's TPE over the 2L binary variables, the warm-start sets enqueued first."""

    def __init__(self, variables: list[str], seed: int, warm: list[dict]):
        try:
            import optuna
        except ModuleNotFoundError:
            raise JspecError("jspec search-skip needs Optuna: pip install 'jspec[knn]'") from None
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self.optuna, self.variables = optuna, variables
        self.dist = {v: optuna.distributions.IntDistribution(0, 1) for v in variables}
        sampler = optuna.samplers.TPESampler(seed=seed, multivariate=True, n_startup_trials=STARTUP)
        self.study = optuna.create_study(direction="maximize", sampler=sampler)
        self.warm, self.trial = warm, None

    def replay(self, done: list[tuple[dict, float]]) -> None:
        for params, value in done:
            self.study.add_trial(self.optuna.trial.create_trial(params=params, distributions=self.dist, value=value))
        for params in self.warm:
            if params not in [p for p, _ in done]:
                self.study.enqueue_trial(params)

    def ask(self) -> dict:
        self.trial = self.study.ask(self.dist)
        return dict(self.trial.params)

    def tell(self, value: float) -> None:
        self.study.tell(self.trial, value)


def read_log(log: Path) -> tuple[dict | None, list[dict], int]:
    """A trial log: its first line ({"search": header}; None when it has none), its trials, and
    the length of the lines they fill: a torn last line (a run killed while appending it) is left
    out, for the search to cut off and run again. Any other damaged line is refused."""
    headed = False  # after the header line, every line is a trial's

    def parse(line: bytes):
        nonlocal headed
        if not line.strip():
            return None
        obj = json.loads(line)
        if not isinstance(obj, dict) or (headed and not {"params", "objective"} <= obj.keys()):
            raise ValueError("not a trial")
        headed = True
        return obj

    objects, keep = files.complete_lines(log.read_bytes(), parse, lambda n: JspecError(
        f"{log} line {n} is damaged; remove the log to search again"))
    return (objects[0] if objects else None), objects[1:], keep


def search(objective, proposer, variables: list[str], trials: int, log: Path, header: dict, report=None):
    """Run trials until the log holds `trials`; returns [(params, value, extra)] of all of them.
    The log's first line is `header`: a log from another search is refused, not mixed in."""
    first, rows, keep = read_log(log) if log.exists() else (None, [], 0)
    if first is None:  # a new log (or one whose header line was torn)
        log.parent.mkdir(parents=True, exist_ok=True)
        files.write_text(log, json.dumps({"search": header}) + "\n")
    elif first != {"search": header}:
        raise JspecError(f"{log} is the log of another search (other prompts, model or settings); "
                         f"remove it or choose another --out")
    elif keep < log.stat().st_size:
        os.truncate(log, keep)
    done = [(t["params"], t["objective"], t) for t in rows]
    proposer.replay([(p, v) for p, v, _ in done])
    with open(log, "a") as f:
        for i in range(len(done), trials):
            params = proposer.ask()
            if sorted(params) != sorted(variables):
                raise AssertionError(f"the sampler proposed {sorted(params)}")
            value, extra = objective(params)
            proposer.tell(value)
            row = {"trial": i, "params": params, "objective": round(value, 4), **extra}
            f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())
            done.append((params, value, row))
            if report is not None:
                report(i, row, max(done, key=lambda d: d[1]))
    return done


def search_set(model, prompts: list[dict], out: Path, name: str, *, source: str, category: str | None,
               trials: int = 40, count: int = 8, max_new_tokens: int = 32, max_prompt_tokens: int = 1024,
               seed: int = 0, objective: str = "measured", one_bucket: bool = True) -> tuple[knn.SkipSet, float, dict]:
    """Search `name`'s skip set on `prompts` (of `source`, `category`), logging every trial to
    OUT.trials.jsonl and resuming from it, and write the best set to `out`; returns (set, its
    objective, its trial's row)."""
    from tqdm import tqdm

    cfg = model.cfg
    out.parent.mkdir(parents=True, exist_ok=True)
    requests = pick(model, prompts, count, seed, max_prompt_tokens, one_bucket)
    variables = names(cfg.num_layers)
    header = {"model": folder.fingerprint(cfg), "prompts": source, "category": category,
              "ids": [r.id for r in requests], "max_new_tokens": max_new_tokens, "seed": seed,
              "objective": objective}
    n = cfg.num_layers
    # Half the sublayers drawn at random almost never drafts an accepted token, so with a small
    # budget the warm starts carry the search: whole layers, attention only and MLP only, of
    # SWIFT's starting point and (default model) the shipped layer-skip set.
    starts = [tuple(range(n // 4 + 1, n - n // 4, 2))]
    default = shipped.find(model, "layer-skip.json")
    if default is not None:
        starts.insert(0, tuple(json.loads(default.read_text())["skip_layers"]))
    warm = [to_params(knn.SkipSet("", a, m), n) for layers in starts
            for a, m in ((layers, layers), (layers, ()), ((), layers))]
    proposer = OptunaProposer(variables, seed, warm)
    measure = None

    def trial(params):  # built at the first trial: a finished search reruns nothing
        nonlocal measure
        measure = measure or Measure(model, requests, max_new_tokens, objective)
        return measure(to_set(name, params, n))

    log = out.with_name(out.stem + LOG_SUFFIX)
    bar = tqdm(total=trials, unit="trial", file=sys.stderr, dynamic_ncols=True)

    def report(i, row, best):
        bar.update(1)
        s = to_set(name, best[0], n)
        bar.write(f"trial {i}: {objective} {row['objective']:.3f} ({row['measured_tokens_per_second']:.1f} "
                  f"tokens/s, {row['mean_accepted_tokens']:.2f} accepted); best {best[1]:.3f}: "
                  f"attention {list(s.attention)}, mlp {list(s.mlp)}", file=sys.stderr)

    start = time.perf_counter()
    bar.update(len(read_log(log)[1]) if log.exists() else 0)
    done = search(trial, proposer, variables, trials, log, header, report)
    bar.close()
    params, value, row = max(done, key=lambda d: d[1])
    best = to_set(name, params, n)
    best.info = {"prompts": source, "category": category, "search": {
        "trials": len(done), "prompts_timed": count, "max_new_tokens": max_new_tokens,
        "objective": objective, "value": round(value, 4), "mean_accepted_tokens": row["mean_accepted_tokens"],
        "measured_tokens_per_second": row["measured_tokens_per_second"],
        "ar_tokens_per_second": row.get("ar_tokens_per_second"),
        "sampler": "optuna TPE", "seconds_this_run": round(time.perf_counter() - start, 1)}}
    files.write_text(out, json.dumps(best.to_json(), indent=1) + "\n")
    return best, value, row
