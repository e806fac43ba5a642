"""Decoding through the public API: greedy equals HF `generate`, batching and padding change
nothing, sampling is seeded, EOS stops a row, and a program is compiled once per shape bucket.

Tiny random models (built as `jspec.api.Model(cfg, params)`, fed token ids) cover the
mechanics; the tests marked slow run the default model (SmolLM2-135M-Instruct) end to end.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from conftest import TINY, hf_logits

from jspec.api import Model
from jspec.batching import MIN_PROMPT_BUCKET, Request, batch_rows, batches
from jspec.errors import JspecError

RECORD_FIELDS = {"id", "text", "token_ids", "new_tokens", "prompt_tokens", "seconds", "tokens_per_second", "numerics",
                 "stats", "method"}
# Chat prompts whose encodings differ a lot in length (the template adds ~30 tokens to each).
CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in detail how a refrigerator works, covering the compressor, the condenser, the expansion "
    "valve and the evaporator, and why the refrigerant changes phase along the way. Then compare it with "
    "a heat pump that warms a house in winter, say which parts are the same and which differ, and finish "
    "with three practical tips for making a kitchen refrigerator use less electricity at home.",
]
NEW = 64


def token_prompts(lengths, seed=0, **extra):
    rng = np.random.default_rng(seed)
    return [{"token_ids": rng.integers(0, TINY["vocab_size"], n).tolist(), **extra} for n in lengths]


def ids(records):
    return [r["token_ids"] for r in records]


def hf_greedy(hf, prompt_ids, max_new_tokens, eos_ids) -> list[int]:
    """HF generate's new tokens (EOS included if produced) for one unpadded prompt."""
    x = torch.tensor([prompt_ids])
    eos = dict(eos_token_id=list(eos_ids), pad_token_id=eos_ids[0]) if eos_ids else dict(eos_token_id=None, pad_token_id=0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # on a small shared CPU, 2 torch threads can be 5x slower than 1
    try:
        with torch.no_grad():
            out = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=max_new_tokens,
                              top_k=None, top_p=None, temperature=None, **eos)
    finally:
        torch.set_num_threads(threads)
    return out[0, len(prompt_ids):].tolist()


def check_record(r, prompt_id, prompt_len):
    assert set(r) == RECORD_FIELDS
    assert r["id"] == prompt_id and r["prompt_tokens"] == prompt_len
    assert isinstance(r["token_ids"], list) and all(type(t) is int for t in r["token_ids"])
    assert r["new_tokens"] == len(r["token_ids"]) >= 1
    assert r["seconds"] > 0
    assert r["tokens_per_second"] == pytest.approx(r["new_tokens"] / r["seconds"], rel=1e-3)
    s = r["stats"]
    assert s["mean_accepted_tokens"] == 1.0  # plain decoding: one token per target forward
    assert s["rounds"] == r["new_tokens"]
    assert (s["drafted"], s["accepted"], s["acceptance_rate"]) == (0, 0, None)


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    """The tiny Llama without EOS ids: every row runs to max_new_tokens."""
    return tiny_llama.jspec_model(eos_token_ids=())


# -- tiny model ----------------------------------------------------------------------------------
# Programs are compiled per Model instance and per (rows, bucket, max_new_tokens, sampling), and
# each compile costs seconds on a small shared CPU, so these tests mostly reuse `tiny` with
# max_new_tokens=32 and prompts in the 32 and 64 buckets.

def test_tiny_greedy_matches_hf_generate(tiny_llama, tiny):
    prompts = token_prompts([5, 40], seed=1)
    for p, r in zip(prompts, tiny.generate(prompts, max_new_tokens=32)):
        assert r["token_ids"] == hf_greedy(tiny_llama.hf, p["token_ids"], 32, ())
        assert len(set(r["token_ids"])) > 5  # a real sequence, not one token repeated


def test_mixed_length_batch_equals_batch_of_one(tiny_llama, tiny):
    """Rows of very different lengths, rows that stop early (EOS) and rows that run on, and a
    padding row, share batches without disturbing each other: every row equals its batch-1 run."""
    lengths = [3, 60, 17, 45, 9, 50, 2]  # two batches of 4 by length; the second has a padding row
    prompts = token_prompts(lengths, seed=2)
    free = ids(tiny.generate(prompts, max_new_tokens=32))  # no EOS: all run to 32 tokens
    assert len({tuple(t) for t in free}) == len(prompts) and all(len(t) == 32 for t in free)
    # An EOS id that some rows produce (not too early) and others never do.
    counts = {}
    for row in free:
        for t in set(row[3:]) - set(row[:3]):
            counts[t] = counts.get(t, 0) + 1
    eos = max((t for t, c in counts.items() if c <= len(free) - 2), key=lambda t: counts[t])
    m = tiny_llama.jspec_model(eos_token_ids=(eos,))
    single = m.generate(prompts, max_new_tokens=32)
    batched = m.generate(prompts, max_new_tokens=32, batch_size=4)
    assert ids(batched) == ids(single)
    for row, full in zip(ids(single), free):
        assert row == (full[:full.index(eos) + 1] if eos in full else full)
    assert sum(len(r) < 32 for r in ids(single)) >= 2 and sum(len(r) == 32 for r in ids(single)) >= 2
    for i, r in enumerate(batched):  # in prompt order, though they ran in length order
        check_record(r, i, lengths[i])


def test_a_short_last_batch_runs_at_the_next_power_of_two_rows():
    assert [batch_rows(n, 8) for n in range(1, 9)] == [1, 2, 4, 4, 8, 8, 8, 8]
    assert [batch_rows(n, 6) for n in range(1, 7)] == [1, 2, 4, 4, 6, 6]
    assert [batch_rows(n, 8, shards=4) for n in range(1, 9)] == [8, 8, 4, 4, 8, 8, 8, 8]  # rows split over 4 shards


def test_batches_put_similar_lengths_together():
    requests = [Request(i, [0] * n, i) for i, n in enumerate([3, 60, 17, 45, 9, 50, 2, 17])]
    lengths = lambda bs: [[len(r.token_ids) for r in b] for b in bs]  # noqa: E731
    assert lengths(batches(requests, 4)) == [[2, 3, 9, 17], [17, 45, 50, 60]]
    assert [r.id for r in batches(requests, 4)[0]] == [6, 0, 4, 2]  # equal lengths keep their order
    assert batches(requests, 1) == [[r] for r in requests]
    # A run resumed after its first batch was written batches the rest as the whole run did.
    done = {r.id for r in batches(requests, 3)[0]}
    assert batches([r for r in requests if r.id not in done], 3) == batches(requests, 3)[1:]


def test_sampling_is_seeded(tiny):
    prompts = token_prompts([6, 30], seed=4)
    greedy = ids(tiny.generate(prompts, max_new_tokens=32))
    a = ids(tiny.generate(prompts, max_new_tokens=32, temperature=1.0, seed=7))
    b = ids(tiny.generate(prompts, max_new_tokens=32, temperature=1.0, seed=7))
    c = ids(tiny.generate(prompts, max_new_tokens=32, temperature=1.0, seed=8))
    assert a == b
    assert all(x != y for x, y in zip(a, c))
    # Every sampled row, not just the set, strays from greedy in a good share of positions.
    for x, g in zip(a + c, greedy + greedy):
        assert sum(s != t for s, t in zip(x, g)) >= 8
    # Filters that leave only the best token make sampling greedy.
    assert ids(tiny.generate(prompts, max_new_tokens=32, temperature=1.0, top_k=1, seed=7)) == greedy
    assert ids(tiny.generate(prompts, max_new_tokens=32, temperature=0.7, top_p=1e-6, seed=9)) == greedy


def test_sampled_top_k_stays_in_top_k(tiny_llama, tiny):
    """With top-k=3 every sampled token is one of the 3 most likely given the tokens before it."""
    prompts = token_prompts([10, 25], seed=5)
    for p, r in zip(prompts, tiny.generate(prompts, max_new_tokens=32, temperature=2.0, top_k=3, seed=1)):
        seq = np.array([p["token_ids"] + r["token_ids"]], np.int32)
        logits = hf_logits(tiny_llama.hf, seq)[0, len(p["token_ids"]) - 1:-1]
        top3 = np.argsort(logits, axis=-1)[:, -3:]
        assert all(t in top for t, top in zip(r["token_ids"], top3))
        assert sum(t != top[-1] for t, top in zip(r["token_ids"], top3)) >= 3  # and not just the argmax


def test_max_new_tokens_one(tiny):
    prompts = token_prompts([5, 50], seed=6, id="x")
    prompts[1]["id"] = "y"
    longer = ids(tiny.generate(prompts, max_new_tokens=32))
    records = tiny.generate(prompts, max_new_tokens=1, batch_size=2)
    assert [r["id"] for r in records] == ["x", "y"]
    assert ids(records) == [row[:1] for row in longer]
    for r, p in zip(records, prompts):
        check_record(r, p["id"], len(p["token_ids"]))
        assert r["stats"]["rounds"] == 1


def test_eos_stops_the_row(tiny_llama, tiny):
    prompts = token_prompts([12, 20], seed=7)
    free = ids(tiny.generate(prompts, max_new_tokens=32))
    k = next(i for i in range(3, 32) if free[0][i] not in free[0][:i])  # first occurrence of a token, late
    eos = free[0][k]
    never = next(t for t in range(TINY["vocab_size"]) if t not in free[0])
    # Several EOS ids, one of them hit by row 0; row 1's first token is an EOS id too.
    m = tiny_llama.jspec_model(eos_token_ids=(never, eos, free[1][0]))
    r0, r1 = m.generate(prompts, max_new_tokens=32)
    assert r0["token_ids"] == free[0][:k + 1]  # up to and including EOS, nothing after it
    assert r0["new_tokens"] == k + 1
    check_record(r0, 0, 12)
    assert r1["token_ids"] == [free[1][0]] and r1["stats"]["rounds"] == 1  # the loop never ran for it
    check_record(r1, 1, 20)


def test_compiled_once_per_bucket(tiny_llama, count_compiles):
    new = 19  # a max_new_tokens no other test uses: jax would reuse an identical program from its own cache
    m = Model(dataclasses.replace(tiny_llama.cfg, eos_token_ids=()), tiny_llama.params)  # nothing compiled yet
    a, b, c = token_prompts([5, MIN_PROMPT_BUCKET - 2, MIN_PROMPT_BUCKET + 9], seed=8)
    m.generate([a], max_new_tokens=new)
    assert len(m.programs()) == 1 and count_compiles  # the counter sees compilations
    compiled = m.programs()
    count_compiles.clear()
    [rb] = m.generate([b], max_new_tokens=new)  # another length, the same bucket
    assert m.programs() == compiled and count_compiles == []  # neither jspec nor jax compiled anything
    count_compiles.clear()
    m.generate([c], max_new_tokens=new)  # the next bucket: one new program
    assert len(m.programs()) == 2 and count_compiles
    count_compiles.clear()
    m.generate([a, b, c], max_new_tokens=new)  # three batches, known shapes: still nothing new
    assert len(m.programs()) == 2 and count_compiles == []
    # Reusing earlier calls' (donated, now stale) caches changed nothing.
    fresh = Model(m.cfg, m.params)
    assert fresh.generate([b], max_new_tokens=new)[0]["token_ids"] == rb["token_ids"]


def test_records_for_token_prompts(tiny):
    prompts = [{"id": "first", "token_ids": [1, 2, 3]}, {"token_ids": [4, 5]}, {"id": 7, "token_ids": [9] * 40}]
    records = tiny.generate(prompts, max_new_tokens=32)
    for r, pid, n in zip(records, ["first", 1, 7], [3, 2, 40]):
        check_record(r, pid, n)
        assert r["text"] is None  # no tokenizer
        assert r["new_tokens"] == 32


def test_bad_requests_are_explained(tiny):
    ok = token_prompts([4])
    with pytest.raises(JspecError, match="max-new-tokens must be >= 1"):
        tiny.generate(ok, max_new_tokens=0)
    with pytest.raises(JspecError, match="batch-size must be >= 1"):
        tiny.generate(ok, batch_size=0)
    with pytest.raises(JspecError, match="unknown method 'nope'"):
        tiny.generate(ok, method="nope")
    with pytest.raises(JspecError, match="exceeds the model's context of 512"):
        tiny.generate(token_prompts([500]), max_new_tokens=13)
    with pytest.raises(JspecError, match="is empty"):
        tiny.generate([{"token_ids": []}])
    with pytest.raises(JspecError, match="has no tokenizer"):
        tiny.generate(["some text"])
    for bad in ([5], [[1, 2, 3]]):  # ids belong in {"token_ids": ...}
        with pytest.raises(JspecError, match="a prompt is a string, a list of chat messages"):
            tiny.generate(bad)
    with pytest.raises(JspecError, match="prompts must be a prompt or an iterable of prompts, got int"):
        tiny.generate(5)
    with pytest.raises(JspecError, match=r"a prompt dict needs 'prompt', 'messages' or 'token_ids'; got keys \['te"):
        tiny.generate([{"text": "hi"}])
    for blank in ("", "  \n"):  # refused as in a prompts file, before the missing tokenizer
        with pytest.raises(JspecError, match="a prompt is empty"):
            tiny.generate(blank)
    with pytest.raises(JspecError, match="token_ids must be integers"):
        tiny.generate([{"token_ids": ["1", "2"]}])
    for name in ("max_new_tokens", "batch_size", "seed"):
        with pytest.raises(JspecError, match=f"{name} must be an integer, got 2.5"):
            tiny.generate(ok, **{name: 2.5})
    for bad in (-1.0, float("nan"), 1e-40):  # 1e-40: logits / temperature overflows float32
        with pytest.raises(JspecError, match="temperature must be 0"):
            tiny.generate(ok, temperature=bad)
    with pytest.raises(JspecError, match=f"top-k must be at most the vocabulary size {tiny.cfg.vocab_size}"):
        tiny.generate(ok, temperature=1.0, top_k=tiny.cfg.vocab_size + 1)
    with pytest.raises(JspecError, match="unknown option 'max_new_token'; generate takes max_new_tokens"):
        tiny.generate(ok, max_new_token=4)
    with pytest.raises(JspecError, match="chat must be True or False, got 'no'"):
        tiny.generate(ok, chat="no")
    for option, phrase in [(dict(method="layer-skip", skip_layers="1,2"), "skip_layers takes a list of layer numbers"),
                           (dict(method="layer-skip", skip_layers=[1.5]), "skip_layers takes a list of layer numbers"),
                           (dict(method="ngram", datastore=5), "datastore takes a string, got 5"),
                           (dict(method="layer-skip", max_draft="3"), "max_draft takes an integer, got '3'"),
                           (dict(method="eagle", candidates=2.0), "candidates takes an integer, got 2.0"),
                           (dict(method="layer-skip", threshold="0.5"), "threshold takes a number, got '0.5'"),
                           (dict(method="mjsd", tree="yes"), "tree takes true or false, got 'yes'"),
                           (dict(method="draft", draft_model=5), "draft_model takes a path or a loaded jspec model")]:
        with pytest.raises(JspecError, match=phrase):
            tiny.generate(ok, **option)
    for name in ("temperature", "top_p"):
        with pytest.raises(JspecError, match=f"{name} must be a number, got '0.5'"):
            tiny.generate(ok, **{name: "0.5"})
    for cut in (dict(top_k=3), dict(top_p=0.5)):
        with pytest.raises(JspecError, match="--top-k and --top-p shape sampling"):
            tiny.generate(ok, **cut)
    for bad in (-1, 2**32):
        with pytest.raises(JspecError, match=r"seed must be in 0\.\.4294967295"):
            tiny.generate(ok, temperature=1.0, seed=bad)


# -- the default model -----------------------------------------------------------------------------

@pytest.mark.parametrize("option, phrase", [("kv_cache_dtype", "unknown KV cache dtype 'float16'"),
                                             ("activation_dtype", "unknown activation dtype 'float16'")])
def test_an_unknown_numerics_dtype_is_refused_before_loading(option, phrase, monkeypatch):
    import jspec
    from jspec.convert import cache

    monkeypatch.setattr(cache, "resolve", lambda *a: pytest.fail("nothing loads for a bad dtype"))
    with pytest.raises(JspecError, match=phrase):
        jspec.load(**{option: "float16"})


def test_chat_messages_must_hold_strings(default_model):
    for message in ({"role": "user", "content": 5}, {"role": "user"}, {"role": 3, "content": "x"}):
        with pytest.raises(JspecError, match='chat messages: message 0 must be an object with string "role" and "content"'):
            default_model.generate([[message]], max_new_tokens=1)
    # A bare list of messages is one conversation, not a list of prompts.
    conversation = [{"role": "user", "content": "Name a prime."}]
    [alone] = default_model.generate(conversation, max_new_tokens=3)
    [listed] = default_model.generate([conversation], max_new_tokens=3)
    assert alone["token_ids"] == listed["token_ids"] and alone["prompt_tokens"] == listed["prompt_tokens"]


def test_a_prompt_no_context_can_hold_is_refused_before_tokenizing(default_model, monkeypatch):
    """A prompt of more characters than the context could hold in any tokenization fails at once,
    as text or as a message, without the tokenizer seeing it."""
    def untouched(*args, **kwargs):
        raise AssertionError("tokenized")

    monkeypatch.setattr(default_model.tokenizer, "encode", untouched)
    monkeypatch.setattr(default_model.tokenizer, "encode_chat", untouched)
    huge = "x" * (4 * default_model.cfg.max_position_embeddings * 200)
    for prompt in (huge, [{"role": "user", "content": huge}]):
        with pytest.raises(JspecError, match=f"far longer than the model's context of "
                                             f"{default_model.cfg.max_position_embeddings} tokens can hold"):
            default_model.generate([prompt], max_new_tokens=1)


@pytest.fixture(scope="module")
def default_greedy(default_model):
    """Batch-1 greedy records of the chat prompts (shared by the HF and the batching tests)."""
    return default_model.generate(CHAT_PROMPTS, max_new_tokens=NEW)


@pytest.fixture(scope="module")
def hf_default():
    """HF's LlamaForCausalLM on the very weights jspec runs: the default GGUF, dequantized."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from jspec.convert.cache import default_gguf
    from jspec.convert.gguf import read_gguf

    config, tensors, _ = read_gguf(str(default_gguf()))
    hf_config = LlamaConfig(**{k: v for k, v in config.items() if k != "architectures"})
    hf = LlamaForCausalLM(hf_config).float().eval()
    missing, unexpected = hf.load_state_dict({k: torch.from_numpy(v) for k, v in tensors.items()}, strict=False)
    assert missing == ["lm_head.weight"] and unexpected == []  # tied: the head is the embedding
    hf.tie_weights()
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    return hf


@pytest.mark.slow
def test_default_greedy_matches_hf_generate(default_model, default_greedy, hf_default):
    m = default_model
    assert m.cfg.eos_token_ids and m.tokenizer is not None
    lengths = [len(m.encode(p)) for p in CHAT_PROMPTS]
    assert max(lengths) > 2.5 * min(lengths)
    for prompt, r in zip(CHAT_PROMPTS, default_greedy):
        prompt_ids = m.encode(prompt)
        assert r["token_ids"] == hf_greedy(hf_default, prompt_ids, NEW, m.cfg.eos_token_ids), prompt
        assert r["text"] == m.tokenizer.decode(r["token_ids"])
        assert r["text"].strip()
    for i, r in enumerate(default_greedy):
        check_record(r, i, lengths[i])
    # The capital question gets its answer, and ends with the end-of-turn token.
    assert "Paris" in default_greedy[0]["text"] and default_greedy[0]["token_ids"][-1] in m.cfg.eos_token_ids


@pytest.mark.slow
def test_default_mixed_length_batch(default_model, default_greedy):
    batched = default_model.generate(CHAT_PROMPTS, max_new_tokens=NEW, batch_size=4)  # 3 prompts + 1 padding row
    assert ids(batched) == ids(default_greedy)
    assert [r["new_tokens"] for r in batched] == [r["new_tokens"] for r in default_greedy]
