"""The Python API: `jspec.load(...)` returns a `Model` whose `generate` returns one record per prompt.

    import jspec
    m = jspec.load()                       # SmolLM2-135M-Instruct, converted once and cached
    [r] = m.generate(["Name three primes."], max_new_tokens=64)
    print(r["text"], r["tokens_per_second"])

Prompts of similar length are batched together (jspec.batching) and prefilled a chunk at a
time, so a program is compiled once per (batch rows, cache length, max_new_tokens, sampling,
method) and never per prompt. Compilation happens before the clock
starts: `seconds` is the wall time of the batch that produced a record, prefill included.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import os
import time
from typing import Iterable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jspec import compilation_cache, distributed, memory, methods
from jspec.batching import (Request, admit_groups, batch_rows, batches, prompt_bucket, prompt_rows, shortest_first,
                            stage_alike, stage_rows)
from jspec.convert import cache as model_cache, store
from jspec.engine import loop, slots
from jspec.engine.pricing import measure as measure_costs, resolve as resolve_pricing
from jspec.engine.programs import Programs, Signature
from jspec.engine.sampling import Sampling
from jspec.errors import JspecError
from jspec.model import kernels, sharding, weights
from jspec.model.config import ModelConfig
from jspec.model.decoder import KVCache
from jspec.model.layout import param_shapes
from jspec.model.numerics import Numerics
from jspec.prompts import Prompt, encode as encode_prompt, is_conversation, requests as make_requests
from jspec.records import record
from jspec.tokenizer import Tokenizer

BATCHING = ("continuous", "static")
NEVER = np.int32(2**31 - 1)  # slots.advance's `until` where no round count ends it


def load(model: str | None = None, dtype: str | None = None, mesh: str | jax.sharding.Mesh | None = None, *,
         kv_cache_dtype: str = "float32", activation_dtype: str = "float32") -> "Model":
    """Load `model` (a converted folder, GGUF file, HF folder or cached hub id; None = the default
    SmolLM2-135M-Instruct) with weights in `dtype` (None: the checkpoint's own: bfloat16 for most HF
    models, float32 for GGUF files and the default model), optionally sharded over `mesh`
    ('data=2,model=4'). Its programs keep the KV cache in `kv_cache_dtype` and the activations in
    `activation_dtype` (jspec.model.numerics: float32, the default, is what keeps speculative
    output token-identical to `ar`). Every process of a multi-process run calls it; a model not yet
    converted is converted once per cache folder (jspec.convert.cache.resolve)."""
    if dtype is not None and dtype not in weights.DTYPES:
        raise JspecError(f"unknown dtype {dtype!r}; choose {', '.join(weights.DTYPES)}")
    policy = Numerics(activation_dtype, kv_cache_dtype)
    mesh = sharding.make_mesh(mesh)
    compilation_cache.use_default()
    path = model_cache.resolve(model, dtype)
    cfg, meta = store.read_meta(path)
    # Placed as stored; a cast on load (store.load) keeps each array's split.
    stored = weights.abstract(param_shapes(cfg), meta["dtype"])
    shardings = sharding.shardings(stored, mesh) if mesh is not None else None
    cfg, params, tokenizer = store.load(path, dtype, shardings)
    default = model is None or model_cache.is_default(meta["source"])
    return Model(cfg, params, tokenizer, mesh, name=model_cache.DEFAULT_MODEL if default else model, numerics=policy)


class Model:
    def __init__(self, cfg: ModelConfig, params, tokenizer: Tokenizer | None = None, mesh=None, name: str = "model",
                 numerics: Numerics = Numerics()):
        self.cfg, self.params, self.tokenizer, self.mesh, self.name = cfg, params, tokenizer, mesh, name
        self.numerics = numerics  # the activation and KV cache dtypes its programs use
        self._programs = Programs()
        self._caches: dict = {}  # (rows, length) -> the last batch's KVCache: one at most, reused or freed
        self._costs: dict = {}  # what round_costs measured, by batch and plan

    # -- prompts -----------------------------------------------------------------------------
    def encode(self, prompt: Prompt, chat: bool = True) -> list[int]:
        """Token ids of a prompt: a string, a list of chat messages, or a dict with one of them."""
        return encode_prompt(self.tokenizer, self.name, self.cfg.max_position_embeddings, prompt, chat)

    def requests(self, prompts: Iterable[Prompt], chat: bool = True, start: int = 0) -> list[Request]:
        """Encode prompts; `start` is the index of the first one in the caller's full list."""
        return make_requests(prompts, self.encode, self.cfg.vocab_size, chat, start)

    # -- generation --------------------------------------------------------------------------
    def generate(self, prompts: Prompt | Iterable[Prompt], method: str = "ar", **options) -> list[dict]:
        """Records (id, text, token_ids, new_tokens, seconds, tokens_per_second, stats) in prompt order.
        `prompts` is one prompt (a string, a list of chat messages, a dict with 'prompt', 'messages'
        or 'token_ids') or an iterable of them."""
        if isinstance(prompts, (str, dict)) or is_conversation(prompts):
            prompts = [prompts]
        elif not isinstance(prompts, Iterable):
            raise JspecError(f"prompts must be a prompt or an iterable of prompts, got {type(prompts).__name__}")
        chat = options.pop("chat", True)
        if not isinstance(chat, bool):
            raise JspecError(f"chat must be True or False, got {chat!r}")
        requests = self.requests(prompts, chat)
        by_index = {r.index: record for r, record in self._stream(requests, method, **options)}
        return [by_index[r.index] for r in requests]

    def stream(self, requests: Sequence[Request], method: str = "ar", **options) -> Iterator[dict]:
        """Check everything, then return an iterator of records that runs batch by batch (the CLI
        writes them as they come). Under continuous batching (the default) they come as their rows
        finish; under static batching in the order of `batches(requests, batch_size)`: the
        requests' own order at batch size 1, shortest prompts first above it.

        `batching`: "continuous" keeps `batch_size` rows decoding, each taking the next request
        (shortest prompts first) as soon as its own ends (jspec.engine.slots); a record's `seconds`
        is then its row's own time, from the call that prefilled it to the end of the call in which
        it finished (compiles excluded). "static" runs batches of `batch_size` requests sorted by
        prompt length, each until its longest row ends; `seconds` is its batch's time. At batch
        size 1 the two are one program. Greedy output is the same under both; a sampled row draws
        from the same distribution under both, but its draws follow the rows it shared steps with,
        so only static batching repeats an uninterrupted run's samples on a resume.

        `logprobs` = k > 0 adds to each record "top_ids" and "top_logprobs" (NumPy [new_tokens, k]):
        the target's k most likely tokens and their untempered log-probabilities behind each
        generated token (the distillation data's teacher, jspec.training.distill).

        `method_options` are those of `jspec.methods.build` (max_draft, controller, exit_layer,
        skip_layers, draft_model, threshold, ...); `draft_model` may be a path or a loaded Model.
        Sampling keys follow the index of each batch's (or admitted group's) first request.
        """
        return (record for _, record in self._stream(requests, method, **options))

    def _stream(self, requests: Sequence[Request], method: str = "ar", *, max_new_tokens: int = 128,
                batch_size: int = 1, batching: str = "continuous", temperature: float = 0.0, top_k: int = 0,
                top_p: float = 1.0, seed: int = 0, logprobs: int = 0, pricing="auto",
                **method_options) -> Iterator[tuple[Request, dict]]:
        """stream()'s (request, record) pairs."""
        unknown = sorted(method_options.keys() - methods.OPTIONS.keys())
        if unknown:
            raise JspecError(f"unknown option {unknown[0]!r}; generate takes max_new_tokens, batch_size, batching, "
                             "temperature, top_k, top_p, seed, logprobs, pricing, chat and the options of "
                             "jspec.methods.build")
        sampling = Sampling(temperature, top_k, top_p)
        method_options = self.load_models(method, method_options)
        plan = methods.build(method, self, **method_options)
        for name, value in (("max_new_tokens", max_new_tokens), ("batch_size", batch_size), ("seed", seed),
                            ("logprobs", logprobs)):
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
                raise JspecError(f"{name} must be an integer, got {value!r}")
        for flag, value in (("--max-new-tokens", max_new_tokens), ("--batch-size", batch_size)):
            if value < 1:
                raise JspecError(f"{flag} must be >= 1, got {value}")
        if batching not in BATCHING:
            raise JspecError(f"--batching must be one of {', '.join(BATCHING)}, got {batching!r}")
        if not 0 <= logprobs <= self.cfg.vocab_size:
            raise JspecError(f"logprobs must be in 0..{self.cfg.vocab_size}, got {logprobs}")
        if top_k > self.cfg.vocab_size:
            raise JspecError(f"--top-k must be at most the vocabulary size {self.cfg.vocab_size}, got {top_k}")
        if not 0 <= seed < 2**32:  # jax keeps 32 bits of a seed: 2**32 would sample what 0 does
            raise JspecError(f"--seed must be in 0..{2**32 - 1}, got {seed}")
        context = self.cfg.max_position_embeddings
        for r in requests:
            if len(r.token_ids) + max_new_tokens > context:
                raise JspecError(
                    f"prompt {r.id!r} has {len(r.token_ids)} tokens; with --max-new-tokens {max_new_tokens} "
                    f"that exceeds the model's context of {context}")
        continuous = batching == "continuous" and batch_size > 1
        recipe = methods.get(method)
        costs = resolve_pricing(pricing, recipe.lossless, plan[0].max_draft, continuous, batch_size,
                                recipe.chooses is not None)
        run = self._continuous if continuous else self._batches
        name = recipe.chooses or method  # the method that decodes: what records name
        return ((r, {**record, "method": name})
                for r, record in run(list(requests), batch_size, max_new_tokens, sampling, seed, plan, logprobs, costs))

    def load_models(self, method: str, options: dict) -> dict:
        """`options` with each model option (a draft model) that names a path loaded in this
        model's dtype and numerics, where `method` takes it (otherwise jspec.methods.check refuses it)."""
        loaded = {name: load(value, self.dtype, kv_cache_dtype=self.numerics.kv_cache,
                             activation_dtype=self.numerics.activations) for name, value in options.items()
                  if isinstance(value, (str, os.PathLike)) and name in methods.OPTIONS
                  and methods.OPTIONS[name].type == "model" and method in methods.TAKES[name]}
        return {**options, **loaded}

    def _batches(self, requests, batch_size, max_new_tokens, sampling, seed, plan, logprobs, costs):
        for batch in batches(requests, batch_size):
            key = jax.random.fold_in(jax.random.key(seed), batch[0].index)
            rows = self.batch_rows(len(batch), batch_size)
            if isinstance(costs, str):  # measured once, on the first batch's shape
                costs = self.round_costs(batch, rows, max_new_tokens, sampling, plan, logprobs)
            records = self.run_batch(batch, rows, max_new_tokens, sampling, key, plan, logprobs, costs)
            yield from zip(batch, records)

    def _continuous(self, requests, batch_size, max_new, sampling, seed, plan, logprobs, costs):
        """Continuous batching (jspec.engine.slots): `batch_size` rows, each refilled with the next
        request (batching.shortest_first) as soon as its own finished. One cache for the run, as
        long as its longest prompt needs."""
        drafter, dparams, _ = plan
        rows = self.batch_rows(len(requests), batch_size)
        length = self.cache_length(requests, max_new, drafter.max_draft)
        eos = self._eos()
        run = functools.partial(self._run_program, plan=plan, max_new=max_new, sampling=sampling, logprobs=logprobs)
        if isinstance(costs, str):  # timed on this run's own programs
            costs = self.round_costs(requests, rows, max_new, sampling, plan, logprobs, length)
        queue = collections.deque(shortest_first(requests))
        held: list[Request | None] = [queue.popleft() for _ in range(min(rows, len(queue)))]
        s, began = self._fill(run, held, rows, length, self._cache(rows, length), eos, seed)
        held += [None] * (rows - len(held))
        began = [began] * rows
        # On a CPU the next prompts are prefilled ahead, `stage` at a time, and handed to slots
        stage, stage_state, staged, stage_began = stage_rows(self.platform, rows), None, [], 0.0
        chunk = loop.prefill_chunk(self.platform, length)
        while True:
            idle = np.asarray([r is None for r in held])
            (s, done, out, stats), _ = run(slots.advance, rows, length, s, eos, self._rows(idle), np.int32(1),
                                           self._on_all(costs), NEVER)
            done, out, stats = distributed.gather((done, out, stats))
            now = self.clock()
            for i in np.flatnonzero(done & ~idle):
                yield held[i], record(held[i], i, out, stats, now - began[i], drafter, self.tokenizer, self.policy())
                held[i] = None
            free = [i for i, r in enumerate(held) if r is None]
            if not queue and not staged and len(free) == rows:
                break
            # Staged prompts first; the queue's next `stage` staged when they are alike (stage_alike)
            while stage and free and (staged or stage_alike([len(r.token_ids) for r in itertools.islice(queue, stage)],
                                                            stage, chunk)):
                if not staged:
                    stage_state, staged, stage_began = self._stage(run, stage, length, stage_state, queue, eos, seed)
                i = free.pop(0)
                row, held[i] = staged.pop(0)
                s, _ = run(slots.admit_staged, rows, length, s, stage_state, np.int32(row), np.int32(i))
                began[i] = stage_began
            # The free slots' prompts in admits of like chunks, a power of two rows each (a program per size)
            coming = [queue.popleft() for _ in free[:len(queue)]]
            for part in admit_groups([len(r.token_ids) for r in coming], chunk):
                take, group = [free[i] for i in part], [coming[i] for i in part]
                n = len(take)
                tokens, lens = self.prompt_rows(group, n, length)
                into = np.asarray(take, np.int32)
                key = jax.random.fold_in(jax.random.key(seed), group[0].index)
                s, now = run(slots.admit, n, length, s, self._rows(tokens), self._rows(lens),
                             self._everywhere(into), eos, key)
                for i, r in zip(take, group):
                    held[i], began[i] = r, now
        self._caches[(rows, length)] = s.cache  # not the stage's: it goes with the run

    def _stage(self, run, n: int, length: int, last, queue: collections.deque, eos, seed):
        """The queue's next n prompts prefilled ahead by fill into a cache of n rows (the `last`
        stage's, donated): (their LoopState, [(row, request)], the clock when the fill began)."""
        group = [queue.popleft() for _ in range(n)]
        cache = self._cache(n, length) if last is None else last.cache
        state, began = self._fill(run, group, n, length, cache, eos, seed)
        return state, list(enumerate(group)), began

    def _fill(self, run, group: Sequence[Request], rows: int, length: int, cache: KVCache, eos, seed):
        """slots.fill of `group` (at most `rows` requests; the rows past them start done) into
        `cache`: (its LoopState, the clock when the fill began)."""
        tokens, lens = self.prompt_rows(group, rows, length)
        key = jax.random.fold_in(jax.random.key(seed), group[0].index)
        active = np.arange(rows) < len(group)
        return run(slots.fill, rows, length, cache, self._rows(tokens), self._rows(lens), self._rows(active), eos, key)

    def _run_program(self, program, rows, length, *args, plan, max_new, sampling, logprobs):
        """program(params, dparams, *args), compiled if need be: its result, and the clock when the
        call began."""
        args = (self.params, plan[1], *args)
        fn = self._program(program, rows, length, args, max_new, sampling, plan, logprobs)
        began = self.clock()
        return fn(*args), began

    def batch_rows(self, n: int, batch_size: int) -> int:
        return batch_rows(n, batch_size, 1 if self.mesh is None else self.mesh.shape["data"])

    @property
    def platform(self) -> str:
        """The jax platform the parameters live on (cpu, cuda, rocm, tpu): what the decoding
        programs are compiled for."""
        return next(iter(jax.tree.leaves(self.params)[0].devices())).platform

    @property
    def dtype(self) -> str:
        """The weights' dtype, by name (float32, bfloat16, int8: jspec.model.weights)."""
        return weights.dtype_of(self.params)

    def policy(self) -> dict:
        """The dtypes and matmul precision its programs run with, as records' settings name them."""
        return {"dtype": self.dtype, **self.numerics.to_json()}

    def run_batch(self, batch: Sequence[Request], rows: int, max_new: int, sampling: Sampling, key,
                  plan, logprobs: int = 0, costs: np.ndarray | None = None) -> list[dict]:
        """One batch, padded to `rows`, through a built plan (`jspec.methods.build`'s drafter, its
        params and controller, or one made by hand, as the skip-set search does), its rounds priced
        by `costs` if given (jspec.engine.pricing): its records, with no checks (`stream` makes them)."""
        drafter, dparams, _ = plan
        length = self.cache_length(batch, max_new, drafter.max_draft)
        tokens, lens = self.prompt_rows(batch, rows, length)
        eos = self._eos()
        args = (self.params, dparams, self._cache(rows, length), self._rows(tokens), self._rows(lens), eos, key,
                self._on_all(costs))
        fn = self._program(loop.generate, rows, length, args, max_new, sampling, plan, logprobs)
        t0 = self.clock()
        out, stats, cache = fn(*args)
        out, stats = distributed.gather((out, stats))
        seconds = self.clock() - t0
        self._caches[(rows, length)] = cache
        return [record(r, i, out, stats, seconds, drafter, self.tokenizer, self.policy()) for i, r in enumerate(batch)]

    @property
    def compiling(self) -> tuple[int, float]:
        """(programs compiled for this model so far, seconds that took); one dropped and needed again counts again."""
        return self._programs.builds, self._programs.build_seconds

    def clock(self) -> float:
        """Seconds, less those spent compiling this model's programs: what records' `seconds` count."""
        return time.perf_counter() - self._programs.build_seconds

    @staticmethod
    def cache_length(batch: Sequence[Request], max_new: int, max_draft: int) -> int:
        """The cache a batch needs: its longest prompt's bucket (jspec.batching.prompt_bucket), the
        new tokens and a round's draft."""
        return memory.cache_length(max(prompt_bucket(len(r.token_ids)) for r in batch), max_new, max_draft)

    @staticmethod
    def prompt_rows(batch: Sequence[Request], rows: int, length: int) -> tuple[np.ndarray, np.ndarray]:
        """The batch's prompts as a prefill takes them (`prompt_rows`): tokens [rows, length] and
        lens [rows]. A padding row (a batch short of `rows`) repeats the first, shortest prompt, so
        it stops when that row stops rather than prolonging the loop."""
        return prompt_rows([r.token_ids for r in batch] + [batch[0].token_ids] * (rows - len(batch)), length)

    def _rows(self, x: np.ndarray) -> jax.Array:
        """Per-row host data [B, ...], split over the mesh's data axis."""
        if self.mesh is None:
            return jnp.asarray(x)
        return distributed.rows_array(x, sharding.rows_sharding(self.mesh, x.shape))

    def _eos(self) -> jax.Array:
        """The ids a row stops at [E], on every device (-1, which no token is, for a model with none)."""
        return self._everywhere(np.asarray(self.cfg.eos_token_ids or (-1,), np.int32))

    def calibrate(self, prompts: Iterable[Prompt], method: str = "ar", *, batch_size: int = 8,
                  max_new_tokens: int = 128, **method_options) -> np.ndarray:
        """The seconds of a round of `method` at each draft length 0..K [K+1] on this model's device,
        for a batch of `batch_size` of `prompts`: what priced rounds decide by (generate's `pricing`)."""
        requests = self.requests(prompts)
        plan = methods.build(method, self, **self.load_models(method, method_options))
        rows = self.batch_rows(min(len(requests), batch_size), batch_size)
        return self.round_costs(requests, rows, max_new_tokens, Sampling(), plan)

    def round_costs(self, requests, rows: int, max_new: int, sampling: Sampling, plan, logprobs: int = 0,
                    length: int | None = None) -> np.ndarray:
        """The seconds of a round at each draft length [K+1] for a batch of `rows` of the first
        requests, timed on their continuous-batching programs (jspec.engine.pricing.measure) the
        first time this model runs the plan at this batch size, and kept; `length` is the cache's
        (by default what those requests need)."""
        drafter, _, controller = plan
        known = (rows, max_new, sampling, drafter, controller, logprobs)
        if known in self._costs:
            return self._costs[known]
        length = length or self.cache_length(requests[:rows], max_new, drafter.max_draft)
        tokens, lens = self.prompt_rows(requests[:rows], rows, length)
        run = functools.partial(self._run_program, plan=plan, max_new=max_new, sampling=sampling, logprobs=logprobs)
        eos, idle = self._eos(), np.zeros(rows, bool)

        def fill():
            return run(slots.fill, rows, length, self._cache(rows, length), self._rows(tokens), self._rows(lens),
                       self._rows(~idle), eos, jax.random.key(0))[0]

        def advance(s, costs, rounds):
            steps = int(s.steps)
            (s, *_), _ = run(slots.advance, rows, length, s, eos, self._rows(idle), np.int32(rows + 1),
                             self._on_all(costs), np.int32(steps + rounds))
            return s, int(s.steps) - steps

        self._costs[known], s = measure_costs(fill, advance, drafter.max_draft)
        self._caches[(rows, length)] = s.cache
        return self._costs[known]

    def _on_all(self, x: np.ndarray | None) -> jax.Array | None:
        return None if x is None else self._everywhere(np.asarray(x, np.float32))

    def _everywhere(self, x: np.ndarray) -> jax.Array:
        """Host data every device holds whole."""
        return jnp.asarray(x) if self.mesh is None else distributed.rows_array(x, sharding.replicated(self.mesh))

    def _cache(self, rows: int, length: int) -> KVCache:
        """The cache of a batch of `rows` x `length`: the last batch's where its shape is the same (the
        loop donates it, so it is written in place), else a new one (`memory.replace_cache`). One
        cache is alive at a time."""
        cache = self._caches.pop((rows, length), None)
        if cache is not None:
            return cache
        cache = memory.replace_cache(self.cfg, rows, length, self.mesh, self.numerics.kv_cache_dtype, self._caches)
        self._caches.clear()
        return cache

    def programs(self) -> dict:
        """The decoding programs compiled so far (jax.stages.Compiled), by their
        jspec.engine.programs.Signature, as many as this process keeps."""
        return self._programs.compiled()

    def _program(self, program, rows, length, args, max_new, sampling, plan, logprobs):
        """`program` (loop.generate, or one of jspec.engine.slots') compiled for args (params, dparams,
        then its own), or the one kept from before."""
        drafter, dparams, controller = plan
        run = loop.Run(self.cfg, sampling, max_new, drafter, controller, logprobs, self.numerics, self.platform,
                       self.mesh)
        shapes = lambda tree: (jax.tree.structure(tree), tuple((x.shape, str(x.dtype)) for x in jax.tree.leaves(tree)))
        sig = Signature(program.__name__, rows, length, run, shapes(dparams), shapes(args[2:]))

        def build():
            several = self.mesh is not None and self.mesh.devices.size > 1
            with kernels.off() if several else contextlib.nullcontext():
                return program.lower(*args, run=run).compile()

        return self._programs.get(sig, build)
