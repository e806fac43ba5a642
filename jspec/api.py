"""The Python API: `jspec.load(...)` returns a `Model` whose `generate` returns one record per prompt.

    import jspec
    m = jspec.load()                       # SmolLM2-135M-Instruct, converted once and cached
    [r] = m.generate(["Name three primes."], max_new_tokens=64)
    print(r["text"], r["tokens_per_second"])

Prompts of similar length are batched together and packed end to end for the prefill
(jspec.batching), so a program is compiled once per (batch rows, prompt bucket, packed bucket,
max_new_tokens, sampling, method) and never per prompt. Compilation happens before the clock
starts: `seconds` is the wall time of the batch that produced a record, prefill included.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import time
from typing import Any, Iterable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jspec import compilation_cache, distributed, methods
from jspec.batching import Request, batch_rows, batches, pack
from jspec.convert import cache as model_cache, store
from jspec.engine import loop
from jspec.engine.programs import Programs
from jspec.engine.sampling import Sampling
from jspec.errors import JspecError
from jspec.jsonl import check_messages
from jspec.model import kernels, sharding
from jspec.model.config import ModelConfig
from jspec.model.decoder import KVCache, Packing
from jspec.model.layout import param_shapes
from jspec.model.numerics import DTYPES, Numerics
from jspec.tokenizer import Tokenizer

CACHE_ALIGN = 64  # cache lengths are multiples of this: fewer programs
GIB = 1 << 30

Prompt = str | Sequence[dict] | dict


def _is_conversation(prompts: Any) -> bool:
    """A list of chat messages is one prompt, not a list of prompts: prompt dicts never have a role."""
    return (isinstance(prompts, (list, tuple)) and bool(prompts)
            and all(isinstance(m, dict) and "role" in m for m in prompts))


def load(model: str | None = None, dtype: str | None = None, mesh: str | jax.sharding.Mesh | None = None, *,
         kv_cache_dtype: str = "float32", activation_dtype: str = "float32") -> "Model":
    """Load `model` (a converted folder, GGUF file, HF folder or cached hub id; None = the default
    SmolLM2-135M-Instruct) with weights in `dtype` (None: the checkpoint's own: bfloat16 for most HF
    models, float32 for GGUF files and the default model), optionally sharded over `mesh`
    ('data=2,model=4'). Its programs keep the KV cache in `kv_cache_dtype` and the activations in
    `activation_dtype` (jspec.model.numerics: float32, the default, is what keeps speculative
    output token-identical to `ar`). Every process of a multi-process run calls it; a model not yet
    converted is converted once per cache folder (jspec.convert.cache.resolve)."""
    if dtype is not None and dtype not in DTYPES:
        raise JspecError(f"unknown dtype {dtype!r}; choose float32 or bfloat16")
    policy = Numerics(activation_dtype, kv_cache_dtype)
    mesh = sharding.make_mesh(mesh)
    compilation_cache.use_default()
    path = model_cache.resolve(model, dtype)
    cfg, meta = store.read_meta(path)
    shardings = sharding.shardings(param_shapes(cfg), mesh) if mesh is not None else None
    cfg, params, tokenizer = store.load(path, dtype, shardings)
    default = model is None or model_cache.is_default(meta["source"])
    return Model(cfg, params, tokenizer, mesh, name=model_cache.DEFAULT_MODEL if default else model, numerics=policy)


def cache_bytes(cfg: ModelConfig, rows: int, length: int, mesh: jax.sharding.Mesh | None = None,
                dtype=jnp.float32) -> int:
    """Bytes one device holds of a batch's KV cache (`KVCache.zeros`: k and v of each layer,
    [rows, length, kv heads, head dim] in `dtype`), split over `mesh` as `sharding.cache_sharding`
    splits it."""
    leaves = jax.tree.leaves(jax.eval_shape(functools.partial(KVCache.zeros, cfg, rows, length, dtype)))
    share = lambda x: x.shape if mesh is None else sharding.cache_sharding(mesh, x.shape).shard_shape(x.shape)
    return sum(math.prod(share(x)) * x.dtype.itemsize for x in leaves)


def check_cache_fits(rows: int, length: int, need: int, stats: dict | None, freed: int = 0) -> None:
    """Refuse a KV cache of `need` bytes per device that the memory left free on a device (its
    `memory_stats()`, once `freed` bytes, the cache kept from the last batch, are freed) cannot
    hold. A device that reports no limit is not checked. The program's own temporaries, a
    drafter's cache among them, come on top: passing is no promise that it runs."""
    if not stats or "bytes_limit" not in stats:
        return
    free = stats["bytes_limit"] - stats.get("bytes_in_use", 0) + freed
    if need > free:
        raise JspecError(
            f"the KV cache of {rows} row{'s' * (rows != 1)} x {length} positions needs {need / GIB:.2f} GiB per "
            f"device but the device has {max(free, 0) / GIB:.2f} GiB free: use a smaller --batch-size or "
            "--max-new-tokens, shorter prompts, a --mesh with more data or model shards, --kv-cache-dtype bfloat16 or "
            "--dtype bfloat16 weights")


def _memory_stats(mesh: jax.sharding.Mesh | None) -> list[dict | None]:
    """The memory stats of each device of this process that a cache goes to. A CPU device reports
    none: its memory is the host's, shared by this process's CPU devices, so each gets its part of
    what the host has available."""
    devices = jax.local_devices()[:1] if mesh is None else list(mesh.local_devices)
    stats = [d.memory_stats() for d in devices]
    cpus = sum(s is None and d.platform == "cpu" for d, s in zip(devices, stats))
    host = host_memory_available() if cpus else None
    return [{"bytes_limit": host // cpus, "bytes_in_use": 0} if s is None and d.platform == "cpu" and host else s
            for d, s in zip(devices, stats)]


def host_memory_available() -> int | None:
    """Bytes the host can still give this process without swapping (Linux's MemAvailable), or None
    where the system does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


class Model:
    def __init__(self, cfg: ModelConfig, params, tokenizer: Tokenizer | None = None, mesh=None, name: str = "model",
                 numerics: Numerics = Numerics()):
        self.cfg, self.params, self.tokenizer, self.mesh, self.name = cfg, params, tokenizer, mesh, name
        self.numerics = numerics  # the activation and KV cache dtypes its programs use
        self._programs = Programs()
        self._caches: dict = {}  # (rows, length) -> the last batch's KVCache: one at most, reused or freed

    # -- prompts -----------------------------------------------------------------------------
    def encode(self, prompt: Prompt, chat: bool = True) -> list[int]:
        """Token ids of a prompt: a string, a list of chat messages, or a dict with one of them."""
        if isinstance(prompt, dict):
            if "messages" not in prompt and "prompt" not in prompt:
                raise JspecError(f"a prompt dict needs 'prompt', 'messages' or 'token_ids'; got keys {sorted(prompt)}")
            prompt = prompt.get("messages", prompt.get("prompt"))
        if not (isinstance(prompt, str) or
                isinstance(prompt, (list, tuple)) and all(isinstance(m, dict) for m in prompt)):
            raise JspecError("a prompt is a string, a list of chat messages ({'role': ..., 'content': ...}) or a "
                             f"dict with 'prompt', 'messages' or 'token_ids'; got {type(prompt).__name__}")
        if isinstance(prompt, str) and not prompt.strip():
            raise JspecError("a prompt is empty")  # as in a prompts file (jspec.jsonl.read_prompts)
        if self.tokenizer is None:
            raise JspecError(f"model {self.name} has no tokenizer: pass token ids instead of text")
        self._check_length(prompt if isinstance(prompt, str) else "".join(str(m.get("content", "")) for m in prompt))
        if isinstance(prompt, str) and not chat:
            return self.tokenizer.encode(prompt)
        if not chat:
            raise JspecError("chat messages need the chat template; give plain prompts to use --no-chat")
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else \
            check_messages(list(prompt), "chat messages")
        if self.tokenizer.chat_template is None:
            raise JspecError(f"model {self.name} has no chat template: use --no-chat")
        return self.tokenizer.encode_chat(messages)

    def _check_length(self, text: str) -> None:
        """Refuse, before tokenizing it, a text that no tokenization could fit in the context: a
        token covers at most the vocabulary's longest entry in characters (times 4, for what a
        normalizer may compose), so a 100 MB prompt fails at once rather than after minutes."""
        context = self.cfg.max_position_embeddings
        if len(text) > 4 * context * self._longest_token:
            raise JspecError(f"a prompt of {len(text)} characters is far longer than the model's context of "
                             f"{context} tokens can hold")

    @functools.cached_property
    def _longest_token(self) -> int:
        return max(map(len, self.tokenizer.backend.get_vocab(with_added_tokens=True)), default=1)

    def requests(self, prompts: Iterable[Prompt], chat: bool = True, start: int = 0) -> list[Request]:
        """Encode prompts; `start` is the index of the first one in the caller's full list."""
        out = []
        for i, p in enumerate(prompts, start):
            pid = p.get("id", i) if isinstance(p, dict) else i
            if isinstance(p, dict) and "token_ids" in p:
                ids = list(p["token_ids"])
                if not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in ids):
                    raise JspecError(f"prompt {pid!r}: token_ids must be integers")
            else:
                ids = self.encode(p, chat)
            if not ids:
                raise JspecError(f"prompt {pid!r} is empty")
            if max(ids) >= self.cfg.vocab_size or min(ids) < 0:
                raise JspecError(f"prompt {pid!r} holds token ids outside the model's vocabulary (0..{self.cfg.vocab_size - 1})")
            out.append(Request(pid, ids, i))
        return out

    # -- generation --------------------------------------------------------------------------
    def generate(self, prompts: Prompt | Iterable[Prompt], method: str = "ar", **options) -> list[dict]:
        """Records (id, text, token_ids, new_tokens, seconds, tokens_per_second, stats) in prompt order.
        `prompts` is one prompt (a string, a list of chat messages, a dict with 'prompt', 'messages'
        or 'token_ids') or an iterable of them."""
        if isinstance(prompts, (str, dict)) or _is_conversation(prompts):
            prompts = [prompts]
        elif not isinstance(prompts, Iterable):
            raise JspecError(f"prompts must be a prompt or an iterable of prompts, got {type(prompts).__name__}")
        chat = options.pop("chat", True)
        if not isinstance(chat, bool):
            raise JspecError(f"chat must be True or False, got {chat!r}")
        requests = self.requests(prompts, chat)
        records = self.stream(requests, method, **options)
        ran = [r for batch in batches(requests, options.get("batch_size", 1)) for r in batch]
        by_index = {r.index: record for r, record in zip(ran, records)}
        return [by_index[r.index] for r in requests]

    def stream(self, requests: Sequence[Request], method: str = "ar", *, max_new_tokens: int = 128,
               batch_size: int = 1, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
               seed: int = 0, logprobs: int = 0, **method_options) -> Iterator[dict]:
        """Check everything, then return an iterator of records that runs batch by batch (the CLI
        writes them as they come). They come in the order of `batches(requests, batch_size)`:
        the requests' own order at batch size 1, shortest prompts first above it.

        `logprobs` = k > 0 adds to each record "top_ids" and "top_logprobs" (NumPy [new_tokens, k]):
        the target's k most likely tokens and their untempered log-probabilities behind each
        generated token (the distillation data's teacher, jspec.training.distill).

        `method_options` are those of `jspec.methods.build` (max_draft, controller, exit_layer,
        skip_layers, draft_model, threshold, ...); `draft_model` may be a path or a loaded Model.
        Sampling keys follow the index of each batch's first request, so a resumed run samples
        what the uninterrupted run would have (for the same batch size).
        """
        unknown = sorted(method_options.keys() - methods.OPTIONS.keys())
        if unknown:
            raise JspecError(f"unknown option {unknown[0]!r}; generate takes max_new_tokens, batch_size, temperature, "
                             "top_k, top_p, seed, logprobs, chat and the options of jspec.methods.build")
        for name, value in (("temperature", temperature), ("top_p", top_p)):
            if not isinstance(value, (int, float, np.integer, np.floating)) or isinstance(value, bool):
                raise JspecError(f"{name} must be a number, got {value!r}")
        method_options = self.load_models(method, method_options)
        plan = methods.build(method, self, **method_options)
        for name, value in (("max_new_tokens", max_new_tokens), ("batch_size", batch_size), ("seed", seed),
                            ("logprobs", logprobs), ("top_k", top_k)):
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
                raise JspecError(f"{name} must be an integer, got {value!r}")
        if max_new_tokens < 1:
            raise JspecError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
        if batch_size < 1:
            raise JspecError(f"--batch-size must be >= 1, got {batch_size}")
        if not 0 <= logprobs <= self.cfg.vocab_size:
            raise JspecError(f"logprobs must be in 0..{self.cfg.vocab_size}, got {logprobs}")
        sampling = Sampling(temperature, top_k, top_p)
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
        return self._batches(list(requests), batch_size, max_new_tokens, sampling, seed, plan, logprobs)

    def load_models(self, method: str, options: dict) -> dict:
        """`options` with each model option (a draft model) that names a path loaded in this
        model's dtype and numerics, where `method` takes it (otherwise jspec.methods.check refuses it)."""
        loaded = {name: load(value, self.dtype, kv_cache_dtype=self.numerics.kv_cache,
                             activation_dtype=self.numerics.activations) for name, value in options.items()
                  if isinstance(value, (str, os.PathLike)) and name in methods.OPTIONS
                  and methods.OPTIONS[name].type == "model" and method in methods.TAKES[name]}
        return {**options, **loaded}

    def _batches(self, requests, batch_size, max_new_tokens, sampling, seed, plan, logprobs) -> Iterator[dict]:
        for batch in batches(requests, batch_size):
            key = jax.random.fold_in(jax.random.key(seed), batch[0].index)
            yield from self.run_batch(batch, self.batch_rows(len(batch), batch_size), max_new_tokens, sampling,
                                      key, plan, logprobs)

    def batch_rows(self, n: int, batch_size: int) -> int:
        return batch_rows(n, batch_size, 1 if self.mesh is None else self.mesh.shape["data"])

    @property
    def platform(self) -> str:
        """The jax platform the parameters live on (cpu, cuda, rocm, tpu): what the decoding
        programs are compiled for."""
        return next(iter(jax.tree.leaves(self.params)[0].devices())).platform

    @property
    def dtype(self) -> str:
        """The parameters' dtype, by name (float32, bfloat16)."""
        dtype = jax.tree.leaves(self.params)[0].dtype
        return next(name for name, d in DTYPES.items() if d == dtype)

    def policy(self) -> dict:
        """The dtypes and matmul precision its programs run with, as records' settings name them."""
        return {"dtype": self.dtype, **self.numerics.to_json()}

    def run_batch(self, batch: Sequence[Request], rows: int, max_new: int, sampling: Sampling, key,
                  plan, logprobs: int = 0) -> list[dict]:
        """One batch, padded to `rows`, through a built plan (`jspec.methods.build`'s drafter, its
        params and controller, or one made by hand, as the skip-set search does): its records, with
        no checks (`stream` makes them)."""
        drafter, dparams, _ = plan
        tokens, packing = self.pack(batch, rows)
        s = -(-(packing.bucket + max_new + drafter.max_draft + 1) // CACHE_ALIGN) * CACHE_ALIGN
        eos = np.asarray(self.cfg.eos_token_ids or (-1,), np.int32)
        args = self._place(tokens, packing, eos)
        cache = self._cache(rows, s)
        fn = self._compile(rows, tokens.shape[1], s, max_new, sampling, plan, cache, args, key, logprobs)
        t0 = time.perf_counter()
        out, stats, cache = fn(self.params, dparams, cache, *args, key)
        out, stats = distributed.gather((out, stats))
        seconds = time.perf_counter() - t0
        self._caches[(rows, s)] = cache
        top = {name: stats.pop(name) for name in ("top_ids", "top_logprobs") if name in stats}
        finite = stats.pop("finite")
        if not finite[:len(batch)].all():
            first = batch[int(np.argmin(finite[:len(batch)]))]
            raise JspecError(f"the model's first logits for prompt {first.id!r} are not finite numbers (NaN or "
                             f"infinity): its weights or its dtypes ({self.dtype} weights, {self.numerics.activations} "
                             "activations) cannot run it")
        records = [self._record(r, out[i, :stats["new_tokens"][i]], {k: v[i].tolist() for k, v in stats.items()},
                                seconds) for i, r in enumerate(batch)]
        for i, record in enumerate(records):
            record["stats"].update(drafter.record_stats({k: v[i].tolist() for k, v in stats.items()}))
            record.update({name: x[i, :record["new_tokens"]] for name, x in top.items()})
        return records

    def pack(self, batch: Sequence[Request], rows: int) -> tuple[np.ndarray, Packing]:
        """The batch's prompts packed for its prefill (`pack`), one packed row per data shard (one
        in all when the rows do not split over them). A padding row (a batch short of `rows`)
        repeats the first, shortest prompt, so it stops when that row stops rather than
        prolonging the loop."""
        prompts = [r.token_ids for r in batch] + [batch[0].token_ids] * (rows - len(batch))
        shards = 1 if self.mesh is None else self.mesh.shape["data"]
        return pack(prompts, shards if rows % shards == 0 else 1)

    def _place(self, tokens, packing, eos):
        if self.mesh is None:
            return jnp.asarray(tokens), jax.tree.map(jnp.asarray, packing), jnp.asarray(eos)
        rows = lambda x: distributed.rows_array(x, sharding.rows_sharding(self.mesh, x.shape))
        return (rows(tokens), jax.tree.map(rows, packing),
                distributed.rows_array(eos, sharding.replicated(self.mesh)))

    def _cache(self, rows: int, length: int) -> KVCache:
        """The cache of a batch of `rows` x `length`: the last batch's where its shape is the same (the
        loop donates it, so it is written in place), else a new one, checked to fit the device and
        made once the last batch's is freed. One cache is alive at a time."""
        cache = self._caches.pop((rows, length), None)
        if cache is not None:
            return cache
        dtype = self.numerics.kv_cache_dtype
        need = cache_bytes(self.cfg, rows, length, self.mesh, dtype)
        freed = sum(cache_bytes(self.cfg, *shape, self.mesh, dtype) for shape in self._caches)
        for stats in _memory_stats(self.mesh):
            check_cache_fits(rows, length, need, stats, freed)
        for old in self._caches.values():
            for x in jax.tree.leaves(old):
                x.delete()  # now, not whenever the last reference goes: before the new one is made
        self._caches.clear()
        zeros = functools.partial(KVCache.zeros, self.cfg, rows, length, dtype)
        if self.mesh is None:
            return zeros()
        # made in place on each device: a multi-process mesh has devices this process cannot feed
        shape = (rows, length, self.cfg.num_kv_heads, self.cfg.head_dim)
        return jax.jit(zeros, out_shardings=sharding.cache_sharding(self.mesh, shape))()

    def programs(self) -> dict:
        """The decoding programs compiled so far (jax.stages.Compiled), by their signature:
        (rows, prompt bucket, cache length, max new tokens, sampling, drafter, controller, ..., logprobs,
        numerics, platform), as many as this process keeps (jspec.engine.programs)."""
        return self._programs.compiled()

    def _compile(self, rows, p, s, max_new, sampling, plan, cache, args, key, logprobs):
        drafter, dparams, controller = plan
        shapes = tuple((x.shape, str(x.dtype)) for x in jax.tree.leaves(dparams))
        sig = (rows, p, s, max_new, sampling, drafter, controller, jax.tree.structure(dparams), shapes, logprobs,
               self.numerics, self.platform)

        def build():
            several = self.mesh is not None and self.mesh.devices.size > 1
            with kernels.off() if several else contextlib.nullcontext():
                lowered = loop.generate.lower(self.params, dparams, cache, *args, key, cfg=self.cfg, sampling=sampling,
                                              max_new_tokens=max_new, drafter=drafter, controller=controller,
                                              logprobs=logprobs, numerics=self.numerics, platform=self.platform)
            return lowered.compile()

        return self._programs.get(sig, build)

    def _record(self, req: Request, ids: np.ndarray, stats: dict, seconds: float) -> dict:
        ids = [int(t) for t in ids]
        text = self.tokenizer.decode(ids) if self.tokenizer is not None else None
        new = len(ids)
        return {
            "id": req.id,
            "text": text,
            "token_ids": ids,
            "new_tokens": new,
            "prompt_tokens": len(req.token_ids),
            "seconds": round(seconds, 6),
            "tokens_per_second": round(new / seconds, 3) if seconds > 0 else None,
            "numerics": self.policy(),
            "stats": {
                "rounds": stats["rounds"],
                "drafted": stats["drafted"],
                "accepted": stats["accepted"],
                "mean_accepted_tokens": round(new / max(stats["rounds"], 1), 4),
                "acceptance_rate": round(stats["accepted"] / stats["drafted"], 4) if stats["drafted"] else None,
            },
        }


def steady_run(model, run):
    """`run()`, and once more if it compiled a program: a program's first run pays for its first
    execution (a second or more on a long prompt's bucket), so the second run is the one to time.
    For scripts that time runs one by one; `run_jspec` warms each program before its clock instead."""
    programs = len(model.programs())
    out = run()
    return run() if len(model.programs()) > programs else out
