"""The `jspec` command line on a tiny random Llama: output, resumable JSONL, one-line errors."""

from __future__ import annotations

import gzip
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.cli import PROMPTS, assert_one_error, read_jsonl, run, tiny, tiny_model, write_lines  # noqa: F401
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import jspec.api
import jspec.batching
import jspec.cli.env
from jspec.convert import store
from jspec.jsonl import RecordWriter, read_prompts, read_records

FIELDS = {"id", "text", "token_ids", "new_tokens", "prompt_tokens", "seconds", "tokens_per_second", "numerics",
          "stats", "method", "prompt_sha256"}
TIMING = ("seconds", "tokens_per_second")
GEN = ["--max-new-tokens", "4"]


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("JSPEC_CACHE", str(tmp_path / "cache"))






@pytest.fixture(scope="module")
def short(tmp_path_factory, default_tokenizer) -> str:
    """A tiny model whose context is only 64 positions."""
    return tiny_model(tmp_path_factory.mktemp("short"), default_tokenizer, max_position_embeddings=64)








def untimed(record: dict) -> dict:
    return {k: v for k, v in record.items() if k not in TIMING}




# -- generate ----------------------------------------------------------------------------------

def test_undecodable_prompt_is_one_line(capsys, tiny):
    """Bytes that are not UTF-8 reach Python's argv as lone surrogates, which no tokenizer encodes."""
    assert_one_error(*run(capsys, "generate", "\udcff\udcfe", "--model", tiny, *GEN), "not valid Unicode text")


def test_generate_one_prompt(capsys, tiny):
    code, out, err = run(capsys, "generate", "Name three primes.", "--model", tiny, *GEN)
    assert code == 0, err
    [expected] = jspec.api.load(tiny).generate("Name three primes.", max_new_tokens=4)
    assert out == expected["text"] + "\n"  # stdout holds the answer and nothing else
    assert re.fullmatch(r"\[\d+ tokens, \d+\.\d\d s, \d+\.\d tokens/s\]\n", err), err


def test_generate_jsonl(capsys, tiny, tmp_path):
    prompts = write_lines(tmp_path / "in.jsonl", PROMPTS[0], "", PROMPTS[1], PROMPTS[2])
    out = tmp_path / "sub" / "out.jsonl"
    code, stdout, err = run(capsys, "generate", "--prompts", prompts, "--output", out, "--model", tiny,
                            "--batch-size", "2", *GEN)
    assert code == 0, err
    assert stdout == ""
    records = read_jsonl(out)
    assert [r["id"] for r in records] == [0, "greeting", 2]
    for r in records:
        assert set(r) == FIELDS
        assert 1 <= r["new_tokens"] <= 4 and len(r["token_ids"]) == r["new_tokens"] and r["text"]
    assert not out.with_name("out.jsonl.partial").exists()
    # Same tokens as the Python API (batch 2 vs batch 1 differs only in padding rows).
    expected = jspec.api.load(tiny).generate(read_prompts(prompts), max_new_tokens=4)
    assert [r["token_ids"] for r in records] == [r["token_ids"] for r in expected]


def interrupt_stream(monkeypatch, after: int, on_interrupt=lambda: None):
    """Model.stream patched to stop as Ctrl-C would once `after` records have come (calling
    `on_interrupt` first); returns the real one, to put back."""
    stream = jspec.api.Model.stream

    def interrupted(self, requests, *args, **kwargs):
        for i, record in enumerate(stream(self, requests, *args, **kwargs)):
            if i == after:
                on_interrupt()
                raise KeyboardInterrupt
            yield record

    monkeypatch.setattr(jspec.api.Model, "stream", interrupted)
    return stream


def test_generate_in_bfloat16_names_its_numerics(capsys, tiny, tmp_path, monkeypatch):
    """Weights, activations and cache in bfloat16 from the command line: each record names them,
    and so do an interrupted run's settings, which a resume must match."""
    prompts = write_lines(tmp_path / "in.jsonl", *PROMPTS)
    out = tmp_path / "out.jsonl"
    bf16 = ("--dtype", "bfloat16", "--kv-cache-dtype", "bfloat16", "--activation-dtype", "bfloat16",
            "--method", "ngram", *GEN)
    with monkeypatch.context() as m:
        interrupt_stream(m, after=1)
        assert run(capsys, "generate", "--prompts", prompts, "--output", out, "--model", tiny, *bf16)[0] == 130
    assert_one_error(*run(capsys, "generate", "--prompts", prompts, "--output", out, "--model", tiny, "--resume",
                          *bf16[:2], *bf16[6:]), "other settings (activation_dtype='bfloat16', "
                                                  "kv_cache_dtype='bfloat16', matmul_precision='default')")
    code, _, err = run(capsys, "generate", "--prompts", prompts, "--output", out, "--model", tiny, "--resume", *bf16)
    assert code == 0, err
    policy = {"dtype": "bfloat16", "activation_dtype": "bfloat16", "kv_cache_dtype": "bfloat16",
              "matmul_precision": "default"}
    assert [r["numerics"] for r in read_jsonl(out)] == [policy] * len(PROMPTS)


def test_generate_and_convert_in_int8(capsys, tiny, tmp_path):
    """--dtype int8 from the command line: generate quantizes a float folder on load, its records
    say int8, and a second run (quantized again) emits the same tokens. (convert: test_convert.)"""
    prompts = write_lines(tmp_path / "in.jsonl", *PROMPTS)
    code, _, err = run(capsys, "generate", "--prompts", prompts, "--output", tmp_path / "a.jsonl", "--model", tiny,
                       "--dtype", "int8", "--method", "ngram", *GEN)
    assert code == 0, err
    records = read_jsonl(tmp_path / "a.jsonl")
    assert [r["numerics"]["dtype"] for r in records] == ["int8"] * len(PROMPTS)
    code, _, err = run(capsys, "generate", "--prompts", prompts, "--output", tmp_path / "b.jsonl", "--model", tiny,
                       "--dtype", "int8", *GEN)
    assert code == 0, err
    assert [r["token_ids"] for r in read_jsonl(tmp_path / "b.jsonl")] == [r["token_ids"] for r in records]


def test_resume_keeps_finished_records(capsys, tiny, tmp_path):
    prompts = write_lines(tmp_path / "in.jsonl", *PROMPTS)
    ref = tmp_path / "ref.jsonl"
    assert run(capsys, "generate", "--prompts", prompts, "--output", ref, "--model", tiny, *GEN)[0] == 0
    reference = read_jsonl(ref)

    # An interrupted run: the first record made it, the second was torn mid-line.
    out = tmp_path / "out.jsonl"
    first = {**reference[0], "text": "kept from the first run"}
    out.with_name("out.jsonl.partial").write_text(json.dumps(first) + "\n" + '{"id": "greeting", "te')
    code, _, err = run(capsys, "generate", "--prompts", prompts, "--output", out, "--model", tiny, "--resume", *GEN)
    assert code == 0, err
    assert "1 of 3" in err
    records = read_jsonl(out)
    assert records[0] == first
    assert [r["id"] for r in records] == [0, "greeting", 2]
    assert [untimed(r) for r in records[1:]] == [untimed(r) for r in reference[1:]]
    assert not out.with_name("out.jsonl.partial").exists()

    # Complete already: --resume has nothing to do; without it a stale partial file is discarded.
    code, _, err = run(capsys, "generate", "--prompts", prompts, "--output", out, "--model", tiny, "--resume", *GEN)
    assert code == 0 and "nothing to do" in err and read_jsonl(out)[0] == first
    more = write_lines(tmp_path / "more.jsonl", *PROMPTS, {"prompt": "One more."})
    assert_one_error(*run(capsys, "generate", "--prompts", more, "--output", out, "--model", tiny, "--resume", *GEN),
                     "is complete and holds other prompts than")
    out.with_name("out.jsonl.partial").write_text(json.dumps(first) + "\n")
    assert run(capsys, "generate", "--prompts", prompts, "--output", out, "--model", tiny, *GEN)[0] == 0
    assert [untimed(r) for r in read_jsonl(out)] == [untimed(r) for r in reference]


def test_resume_refuses_records_the_prompts_no_longer_have(capsys, tiny, tmp_path):
    prompts = write_lines(tmp_path / "in.jsonl", *PROMPTS)
    out = tmp_path / "out.jsonl"
    partial = out.with_name("out.jsonl.partial")
    partial.write_text("".join(json.dumps({"id": i, "token_ids": [1]}) + "\n" for i in ("gone", 0)))
    assert_one_error(*run(capsys, "generate", "--prompts", prompts, "--output", out, "--model", tiny, "--resume", *GEN),
                     'no longer has ("gone")')
    assert len(read_jsonl(partial)) == 2 and not out.exists()


def test_failure_mid_run_leaves_output_untouched(capsys, tiny, tmp_path, monkeypatch):
    """Interrupted in its second batch and resumed, a sampled run at batch 2 writes what an
    uninterrupted one writes, in the prompts' order (its batches ran shortest prompts first)."""
    prompts = write_lines(tmp_path / "in.jsonl", *PROMPTS, {"prompt": "One more."})
    sampled = [*GEN, "--batch-size", "2", "--batching", "static", "--temperature", "1", "--seed", "3"]
    ref = tmp_path / "ref.jsonl"
    assert run(capsys, "generate", "--prompts", prompts, "--output", ref, "--model", tiny, *sampled)[0] == 0
    reference = read_jsonl(ref)
    model = jspec.api.load(tiny)
    first = [r.id for r in jspec.batching.batches(model.requests(read_prompts(prompts)), 2)[0]]
    assert first != [0, "greeting"]  # length order is not file order here

    out = tmp_path / "out.jsonl"
    partial = tmp_path / "out.jsonl.partial"
    earlier = json.dumps({"id": "earlier", "token_ids": [1]}) + "\n"  # an earlier, complete output
    out.write_text(earlier)
    seen = []
    # the first batch (2 records) is written; the run dies in the second
    stream = interrupt_stream(monkeypatch, after=2,
                              on_interrupt=lambda: seen.append((out.read_text(), len(read_jsonl(partial)))))
    code, _, err = run(capsys, "generate", "--prompts", prompts, "--output", out, "--model", tiny, *sampled)
    assert code == 130
    assert seen == [(earlier, 2)]  # OUT untouched while running
    assert out.read_text() == earlier
    assert [r["id"] for r in read_jsonl(partial)] == first
    assert "Traceback" not in err
    line = err.splitlines()[-1]  # after the progress bar, if the first batch was slow enough to show it
    assert line.startswith("jspec: error: interrupted") and "--resume" in line

    monkeypatch.setattr(jspec.api.Model, "stream", stream)
    # Resumed with another seed, the output would mix two runs' samples: refused, nothing touched.
    assert_one_error(*run(capsys, "generate", "--prompts", prompts, "--output", out, "--model", tiny,
                          "--resume", *sampled[:-1], "4"), "was written with other settings (seed=3)")
    assert [r["id"] for r in read_jsonl(partial)] == first
    code, _, err = run(capsys, "generate", "--prompts", prompts, "--output", out, "--model", tiny,
                       "--resume", *sampled)
    assert code == 0, err
    assert [untimed(r) for r in read_jsonl(out)] == [untimed(r) for r in reference]
    assert [r["id"] for r in reference] == [0, "greeting", 2, 3]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "out.jsonl", "ref.jsonl"]  # no partial, no settings


def test_continuous_run_resumed_mid_run_loses_nothing(capsys, tiny, tmp_path, monkeypatch):
    """Five prompts on two rows, continuous: interrupted after three records (rows refilled
    mid-run) and resumed, the output is the uninterrupted run's, in the prompts' order."""
    prompts = write_lines(tmp_path / "in.jsonl", *PROMPTS, {"prompt": "One more."}, {"prompt": "And the last."})
    opts = ["--max-new-tokens", "6", "--batch-size", "2"]
    ref = tmp_path / "ref.jsonl"
    assert run(capsys, "generate", "--prompts", prompts, "--output", ref, "--model", tiny, *opts)[0] == 0
    out = tmp_path / "out.jsonl"
    stream = interrupt_stream(monkeypatch, after=3)
    assert run(capsys, "generate", "--prompts", prompts, "--output", out, "--model", tiny, *opts)[0] == 130
    assert len(read_jsonl(tmp_path / "out.jsonl.partial")) == 3
    monkeypatch.setattr(jspec.api.Model, "stream", stream)
    code, _, err = run(capsys, "generate", "--prompts", prompts, "--output", out, "--model", tiny, "--resume", *opts)
    assert code == 0 and "3 of 5" in err, err
    # Tokens and per-row counters as uninterrupted; batch_rounds counts the run's rounds, which differ.
    same = lambda r: {**untimed(r), "stats": {k: v for k, v in r["stats"].items() if k != "batch_rounds"}}  # noqa: E731
    assert [same(r) for r in read_jsonl(out)] == [same(r) for r in read_jsonl(ref)]
    assert [r["id"] for r in read_jsonl(out)] == [0, "greeting", 2, 3, 4]


def test_record_writer_drops_only_a_torn_last_line(tmp_path):
    out = tmp_path / "out.jsonl"
    partial = tmp_path / "out.jsonl.partial"
    partial.write_text('{"id": 0}\n{"id": 1}\n{"id": 2, "te')
    w = RecordWriter(out, resume=True)
    assert w.done_ids == {0, 1}
    w.write([{"id": 2}])
    w.finish()
    assert read_jsonl(out) == [{"id": 0}, {"id": 1}, {"id": 2}]
    partial.write_text('{"id": 0}\nnot json\n{"id": 2}\n')
    with pytest.raises(jspec.JspecError, match="line 2 is corrupt"):
        RecordWriter(out, resume=True, overwrite=True)  # overwrite: these bare records are not an output's


def test_record_writer_publishes_records_in_prompt_order(tmp_path):
    out = tmp_path / "out.jsonl"
    w = RecordWriter(out)
    w.write([{"id": "b", "text": "line\u2028separator"}, {"id": 0}])  # as batches finished
    w.write([{"id": 2}])
    w.finish(order=[0, "b", 2])
    assert read_jsonl(out) == [{"id": 0}, {"id": "b", "text": "line\u2028separator"}, {"id": 2}]
    assert [p.name for p in tmp_path.iterdir()] == ["out.jsonl"]


def test_record_writer_compresses_a_gz_output(tmp_path):
    out = tmp_path / "out.jsonl.gz"
    w = RecordWriter(out)
    w.write([{"id": 1, "token_ids": [5]}, {"id": 0, "token_ids": [4, 2]}])
    w.finish(order=[0, 1])
    assert gzip.decompress(out.read_bytes()) == b'{"id": 0, "token_ids": [4, 2]}\n{"id": 1, "token_ids": [5]}\n'
    assert [r["id"] for r in read_records(out)] == [0, 1]
    assert [p.name for p in tmp_path.iterdir()] == ["out.jsonl.gz"]


# -- convert -------------------------------------------------------------------------------------

def test_convert(capsys, tmp_path):
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1)).save_pretrained(tmp_path / "hf")
    code, out, err = run(capsys, "convert", tmp_path / "hf", tmp_path / "conv", "--dtype", "bfloat16")
    assert code == 0, err
    assert re.search(r"conv: llama, 1 layers, bfloat16, \d+\.\d\d GiB in \d+\.\d s", out), out
    code, out, err = run(capsys, "convert", tmp_path / "hf", tmp_path / "int8", "--dtype", "int8")
    assert code == 0 and re.search(r"int8: llama, 1 layers, int8, ", out), (out, err)
    assert store.read_meta(tmp_path / "int8")[1]["dtype"] == "int8"
    assert store.is_converted(tmp_path / "conv") and store.read_meta(tmp_path / "conv")[1]["dtype"] == "bfloat16"
    assert all(line.startswith("jspec: warning: ") for line in err.splitlines()), err  # no tokenizer: one line
    assert_one_error(*run(capsys, "convert", tmp_path / "hf", tmp_path / "conv"), "exists and is not empty")
    assert_one_error(*run(capsys, "convert", tmp_path / "hf", tmp_path / "hf" / "config.json"), "is a file")


# -- errors: one line on stderr, no traceback, non-zero exit -------------------------------------



@pytest.mark.parametrize("lines, phrase", [
    (None, "does not exist"),
    (["", "  "], "has no prompts"),
    ([{"prompt": "ok"}, '{"prompt": "a" "b"}'], "line 2: not valid JSON"),
    ([{"text": "no prompt here"}], "line 1: has none of"),
    (["[1, 2]"], "line 1: expected a JSON object"),
    ([{"prompt": "  "}], "line 1: \"prompt\" is empty"),
    ([{"id": "a", "prompt": "x"}, "", {"id": "a", "prompt": "y"}], "line 3: duplicate id \"a\""),
    ([{"messages": "hi"}], "line 1: \"messages\" must be"),
    ([{"token_ids": [1, -2]}], "line 1: \"token_ids\" must be"),
    (['{"prompt": "\\ud800 hi"}'], "line 1: not valid Unicode text (surrogates not allowed at character 0)"),
    ([{"messages": [{"role": "user", "content": "\ud800"}]}], "line 1: not valid Unicode text"),
])
def test_bad_prompts_file(capsys, tmp_path, lines, phrase):
    path = tmp_path / "in.jsonl"
    if lines is not None:
        write_lines(path, *lines)
    # --model names nothing that exists: the prompts must fail first, before any model is loaded.
    result = run(capsys, "generate", "--prompts", path, "--output", tmp_path / "out.jsonl", "--model", tmp_path / "x")
    assert_one_error(*result, phrase)
    assert not (tmp_path / "out.jsonl").exists()


@pytest.mark.parametrize("args, phrase", [
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--batch-size", "0"], "--batch-size must be >= 1"),
    (["--temperature", "-1"], "--temperature must be 0 (greedy) or a number >= 1e-06"),
    (["--temperature", "nan"], "--temperature must be 0"),
    (["--temperature", "1e-40"], "--temperature must be 0"),
    (["--top-p", "nan"], "--top-p must be in"),
    (["--top-p", "0"], "--top-p must be in (0, 1]"),
    (["--method", "nope"], "unknown --method 'nope'; choose one of ar"),
    (["--mesh", "data=two"], "write it as data=N,model=M"),
    (["--mesh", "data=1,data=1"], "each axis at most once"),
    (["--top-k", "4"], "--top-k and --top-p shape sampling"),
    (["--threshold", "7"], "--threshold must be in 0..1"),
    (["--mesh", "data=1", "--coordinator", "localhost:1", "--num-processes", "0", "--process-id", "0"],
     "--num-processes must be >= 1, got 0"),
    (["--mesh", "data=1", "--coordinator", "nowhere", "--num-processes", "2", "--process-id", "1"],
     "--coordinator must be HOST:PORT"),
    (["--init-timeout", "30"], "--init-timeout goes with a multi-process run"),
    (["--max-new-tokens", "many"], "invalid int value"),
    (["--dtype", "float16"], "invalid choice"),
    (["--output", "o.jsonl"], "go with --prompts"),
    (["--prompts", "in.jsonl"], "argument --prompts: not allowed with argument PROMPT"),
    (["--max-draft-len", "4"], "unrecognized arguments: --max-draft-len 4 (see jspec generate --help)"),
])
def test_bad_options_fail_before_loading(capsys, tmp_path, args, phrase):
    assert_one_error(*run(capsys, "generate", "hi", "--model", tmp_path / "missing", *args), phrase)


def test_a_warning_prints_once(capsys, monkeypatch, tmp_path):
    """Once absl (imported by orbax) has given the root logger a handler, a warning still prints
    once, as jspec's one line."""
    monkeypatch.setattr(logging.root, "handlers", [logging.StreamHandler(sys.stderr)])
    code, _, err = run(capsys, "generate", "hi", "--method", "specee", "--model", tmp_path / "missing")
    assert code == 2 and err.count("is lossy") == 1, err


def test_usage_errors(capsys, tmp_path):
    assert_one_error(*run(capsys, "generate"), "give a PROMPT or --prompts")
    assert_one_error(*run(capsys, "generate", "--prompts", "in.jsonl"), "--prompts needs --output")
    prompts = write_lines(tmp_path / "in.jsonl", {"prompt": "hi"})
    assert_one_error(*run(capsys, "generate", "--prompts", prompts, "--output", tmp_path / "." / "in.jsonl"),
                     "is the --prompts file")
    assert prompts.read_text() == '{"prompt": "hi"}\n'
    assert_one_error(*run(capsys, "frobnicate"), "invalid choice")
    # Where the output cannot go is said before any prompt is decoded (the model is not even found).
    inside = prompts / "out.jsonl"
    assert_one_error(*run(capsys, "generate", "--prompts", prompts, "--output", inside, "--model", tmp_path / "missing"),
                     f"cannot write {inside}: {prompts} is a file")
    assert_one_error(*run(capsys, "generate", "--prompts", prompts, "--output", "/proc/out.jsonl",
                          "--model", tmp_path / "missing"), "cannot write /proc/out.jsonl: ")


def test_bad_model(capsys, tmp_path, short):
    assert_one_error(*run(capsys, "generate", "hi", "--model", tmp_path / "no" / "such" / "model"),
                     "neither a local path nor a hub id")
    assert_one_error(*run(capsys, "generate", "hi", "--model", tmp_path / "missing.gguf"),  # no "converting" first
                     "GGUF file")
    assert_one_error(*run(capsys, "generate", "hi", "--model", short, "--mesh", "data=64"), "needs 64 devices")

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16, n_positions=16,
                               bos_token_id=0, eos_token_id=0)).save_pretrained(tmp_path / "gpt2")
    assert_one_error(*run(capsys, "generate", "hi", "--model", tmp_path / "gpt2"), "unsupported architecture GPT2")


def test_prompt_longer_than_context(capsys, tmp_path, short):
    long = "word " * 80
    assert_one_error(*run(capsys, "generate", long, "--model", short, *GEN), "exceeds the model's context of 64")
    prompts = write_lines(tmp_path / "in.jsonl", {"prompt": "short"}, {"prompt": long})
    out = tmp_path / "out.jsonl"
    assert_one_error(*run(capsys, "generate", "--prompts", prompts, "--output", out, "--model", short, *GEN),
                     "prompt 1 has")
    assert not out.exists()


def test_subprocess_error_is_one_line(tmp_path):
    env = {**os.environ, "JSPEC_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run(
        [sys.executable, "-c", "from jspec.cli import main; raise SystemExit(main())",
         "generate", "--prompts", str(tmp_path / "missing.jsonl"), "--output", str(tmp_path / "out.jsonl")],
        capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.splitlines() == [f"jspec: error: prompts file {tmp_path / 'missing.jsonl'} does not exist"]


# -- env -----------------------------------------------------------------------------------------

def _rows(out: str) -> dict[str, str]:
    """`jspec env`'s lines as {name: value}; names may hold single spaces, two or more end them."""
    return dict(re.fullmatch(r"(\s*\S+(?: \S+)*)\s{2,}(.*)", line).groups() for line in out.splitlines())


def test_env_names_versions_devices_and_cache(capsys, tmp_path, monkeypatch):
    import importlib.metadata
    import platform

    import jax

    import jspec.cli
    from jspec import compilation_cache
    from jspec.convert import cache
    from jspec.model import kernels

    folder = tmp_path / "cache"  # the autouse fixture's JSPEC_CACHE
    for name, fmt in (("tiny-float32", store.FORMAT), ("old-bfloat16", store.FORMAT - 1)):
        (folder / name / "params").mkdir(parents=True)
        (folder / name / "params" / "weights").write_bytes(bytes(2_000_000))
        (folder / name / "jspec.json").write_text(json.dumps({"format": fmt, "dtype": name.split("-")[1]}))
    (folder / ".tiny-float32.x1y2").mkdir()  # what an interrupted conversion leaves
    (folder / "xla").mkdir()  # compiled programs (the default compilation cache on an accelerator)
    (folder / "xla" / "jit_generate-0123-cache").write_bytes(bytes(300_000))
    monkeypatch.setattr(jspec.cli.env, "PACKAGES", (*jspec.cli.env.PACKAGES, "no-such-package"))

    def no_loading(*args, **kwargs):
        raise AssertionError("jspec env loads no model")

    monkeypatch.setattr(jspec.api, "load", no_loading)
    monkeypatch.setattr(store, "load", no_loading)
    code, out, err = run(capsys, "env")
    assert code == 0 and err == "", err
    rows = _rows(out)
    assert rows["jspec"] == f"{jspec.__version__} ({Path(jspec.__file__).parent})"
    assert rows["python"].startswith(platform.python_version() + " ")
    for dist in ("jax", "jaxlib", "optax", "orbax-checkpoint", "numpy", "tokenizers", "gguf",
                 "transformers", "torch"):  # the test extra has them all
        assert rows[dist] == importlib.metadata.version(dist), dist
    assert rows["no-such-package"] == "not installed"
    assert rows["jax backend"] == jax.default_backend()
    assert rows["jax devices"] == f"{jax.device_count()} (cpu)"  # conftest's 8 simulated CPU devices
    assert rows["default model"].endswith(str(cache.default_gguf()))
    used = f"used on a CPU ({kernels.paths()}) for "  # the instruction sets the products run on
    assert rows["native kernel"].startswith("not used: " if kernels.unavailable else used)
    assert "activations float32 (--activation-dtype), KV cache float32 (--kv-cache-dtype)" in rows["numerics"]
    assert f"JSPEC_CACHE={folder}" in rows["environment"]
    assert rows["cache"] == str(folder)
    assert rows["  tiny-float32"].startswith(f"float32, format {store.FORMAT}, 2.0 MB")
    assert rows["  old-bfloat16"].startswith(f"bfloat16, format {store.FORMAT - 1} (current: {store.FORMAT}; "
                                             "converted again on next use), 2.0 MB")
    assert rows["  .tiny-float32.x1y2"].startswith("not a converted model")
    assert rows["  xla"] == "compiled programs (the default compilation cache), 0.3 MB"
    assert rows["compilation cache"] == compilation_cache.describe()  # its rules: test_compilation_cache.py


def test_env_is_cheap(tmp_path):
    """A fresh process: versions from package metadata (torch and transformers are not imported),
    and a cache folder that does not exist yet is named as such."""
    env = {**os.environ, "JSPEC_CACHE": str(tmp_path / "nothing-yet")}
    code = ("import sys; from jspec.cli import main; status = main(['env']); "
            "print(status, [m for m in ('torch', 'transformers') if m in sys.modules])")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    *lines, last = proc.stdout.splitlines()
    assert last == "0 []", proc.stderr
    assert _rows("\n".join(lines))["cache"] == f"{tmp_path / 'nothing-yet'} (not created yet)"


@pytest.mark.parametrize("error, line", [
    (RuntimeError("a bug\nin two lines"),
     "a bug in two lines (an unexpected error: RuntimeError; set JSPEC_DEBUG=1 for the traceback)"),
    (MemoryError(), "out of memory: give the command less to hold at once (a smaller model, batch or file), "
                    "or free some"),
], ids=["bug", "memory"])
def test_an_unexpected_error_is_one_line(capsys, tmp_path, monkeypatch, error, line):
    """The last-resort handler: an exception jspec did not expect ends in one line and status 1;
    with JSPEC_DEBUG=1 it propagates, traceback and all."""
    def read_prompts(path):
        raise error

    monkeypatch.setattr("jspec.jsonl.read_prompts", read_prompts)
    argv = ["generate", "--prompts", write_lines(tmp_path / "in.jsonl", *PROMPTS), "--output", tmp_path / "out.jsonl"]
    code, out, err = run(capsys, *argv)
    assert (code, out, err) == (1, "", f"jspec: error: {line}\n")
    assert not (tmp_path / "out.jsonl").exists()
    monkeypatch.setenv("JSPEC_DEBUG", "1")
    with pytest.raises(type(error)):
        jspec.cli.main([str(a) for a in argv])
