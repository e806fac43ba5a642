"""`jspec bench` on a tiny random Llama (with SmolLM2's tokenizer) and a small Spec-Bench-style file:
result rows, resume, the Markdown report between its markers, plots, HF peers, one-line errors;
benchmarks/accelerator.sh shrunk to the same model on the CPU."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from jspec import api, methods
from jspec.bench import report as bench_report
from jspec.bench.specs import parse_batch_sizes, parse_methods, read_bench_prompts
from jspec.cli import main
from jspec.engine.programs import steady_run
from jspec.errors import JspecError
from jspec.parts import heads
from jspec.parts.folder import fingerprint

QUESTIONS = [
    {"question_id": 1, "category": "writing", "turns": ["Write a haiku about rain.", "Now another."]},
    {"question_id": 2, "category": "writing", "turns": ["Describe a cat."]},
    {"question_id": 3, "category": "writing", "turns": ["This one is over the limit."]},
    {"question_id": 4, "category": "qa", "turns": ["What is the capital of France?"]},
]
KEPT = [1, 2, 4]  # --limit 2: two questions per category, in file order
ACCELERATOR_SH = Path(__file__).resolve().parents[2] / "benchmarks" / "accelerator.sh"
OUTER = ("# Benchmarks\n\nhand-written intro\n\n<!-- bench:begin -->\nold table\n<!-- bench:end -->\n\n"
         "hand-written outro\n")


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("JSPEC_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def questions(tmp_path) -> Path:
    path = tmp_path / "questions.jsonl"
    path.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    return path


def run(capsys, *args) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(["bench", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


def rows_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def by_key(rows):
    return {(r["method"], r["batch_size"], r["id"]): r for r in rows}


def test_bench_end_to_end(capsys, tiny_chat_model, questions, tmp_path):
    out, md, img = tmp_path / "res" / "results.jsonl", tmp_path / "docs" / "benchmarks.md", tmp_path / "docs" / "img"
    md.parent.mkdir()
    md.write_text(OUTER)
    common = ["--model", tiny_chat_model, "--prompts", questions, "--limit", 2, "--max-new-tokens", 6, "--output", out]
    code, stdout, err = run(capsys, *common, "--methods", "ngram,early-exit:exit_layer=2", "--batch-sizes", "1,2",
                            "--hf-assisted", "--markdown", md, "--plots", img)
    assert code == 0, err
    rows = rows_of(out)
    keys = by_key(rows)
    methods = ("ar", "ngram", "early-exit:exit_layer=2")
    hf = ("hf", "hf-early-exit", "hf-prompt-lookup")
    expected = {(m, b, i) for m in methods for b in (1, 2) for i in KEPT} | {(m, 1, i) for m in hf for i in KEPT}
    assert set(keys) == expected and len(rows) == len(expected)
    for r in rows:
        assert r["category"] == ("qa" if r["id"] == 4 else "writing")
        assert 1 <= r["new_tokens"] <= 6 and r["tokens_per_second"] > 0 and r["seconds"] > 0
        assert r["mismatch"] is False, r  # lossless: the same tokens as ar
        if r["kind"] == "jspec":
            assert r["mean_accepted_tokens"] >= 1.0 and r["same_as_ar"] is True
    assert all(keys[("ar", 1, i)]["mean_accepted_tokens"] == 1.0 for i in KEPT)
    assert keys[("ar", 2, 1)]["batch_rows"] == 2 and keys[("ar", 2, 4)]["batch_rows"] == 1
    # HF greedy on the same weights gives the same tokens (clear margins on this random model).
    assert all(keys[(m, 1, i)]["same_as_ar"] for m in hf for i in KEPT)
    assert not out.with_name("results.jsonl.partial").exists()

    text = md.read_text()
    assert text.startswith("# Benchmarks\n\nhand-written intro\n\n<!-- bench:begin -->")
    assert text.endswith("<!-- bench:end -->\n\nhand-written outro\n") and "old table" not in text
    block = text[text.index("<!-- bench:begin -->"):]
    for needle in ("### Overall (batch 1)", "### Speedup vs jspec ar by category", "### Batch throughput",
                   "| `ngram` | 3 |", "| `early-exit:exit_layer=2` |", "| `hf` | 3 |", "| `hf-prompt-lookup` | 3 |", "| qa | 1 |",
                   "jspec bench --methods ngram,early-exit:exit_layer=2", "img/bench_speedup_by_category.png",
                   "img/bench_throughput.png", "speedup vs HF generate"):
        assert needle in block, needle
    # No --dtype: the model's line names the dtype it loaded in, the checkpoint's own
    assert re.search(r"^- Model: \S+ \((float32|bfloat16)\); prompts", block, re.M), block[:600]
    overall = block.split("### Overall (batch 1)")[1].split("###")[0]
    assert "| `ar` | 3 |" in overall and overall.count(" | 0 |") == 3  # no mismatches
    assert (img / "bench_speedup_by_category.png").stat().st_size > 1000
    assert (img / "bench_throughput.png").stat().st_size > 1000
    assert "| `ngram` | 3 |" in stdout and "speedup vs jspec ar" in stdout  # the table on stdout too

    # Resume after a finished run, adding a method: only its rows run, the others are kept as they were.
    # Its report goes to another section of the same page (--section), leaving the first as it was.
    code, _, err = run(capsys, *common, "--methods", "ngram,early-exit:exit_layer=2,layer-skip", "--batch-sizes",
                       "1,2", "--batch-methods", "ar", "--hf", "--resume", "--markdown", md, "--section", "more",
                       "--plots", img / "more")
    assert code == 0, err
    assert "resuming: 15 of 18 rows" in err
    again = by_key(rows_of(out))
    assert set(again) == expected | {("layer-skip", 1, i) for i in KEPT}
    assert all(again[k] == keys[k] for k in keys)  # untouched, timings included
    two = md.read_text()
    assert two.startswith(text.rstrip("\n")) and "<!-- more:begin -->\n\n## Results: more" in two
    assert "| `layer-skip` | 3 |" in two.split("<!-- more:begin -->")[1]
    assert (img / "more" / "bench_speedup_by_category.png").is_file()
    assert main(["bench", "--methods", "ar", "--output", str(tmp_path / "x.jsonl"), "--section", "a b"]) == 2

    # An interrupted run (4 rows, then a torn line) resumes where it stopped.
    out2 = tmp_path / "res" / "again.jsonl"
    lines = [line for line in out.read_text().splitlines(keepends=True)
             if json.loads(line)["method"] in ("ar", "ngram") and json.loads(line)["batch_size"] == 1]
    out2.with_name("again.jsonl.partial").write_text("".join(lines[:3]) + lines[3][:20])
    code, _, err = run(capsys, *common[:-1], out2, "--methods", "ngram", "--resume")
    assert code == 0, err
    assert "resuming: 3 of 6 rows" in err
    resumed = by_key(rows_of(out2))
    assert len(resumed) == 6 and all(resumed[k] == again[k] for k in list(resumed)[:3])


def test_resume_refuses_other_settings(capsys, tiny_chat_model, questions, tmp_path):
    out = tmp_path / "r.jsonl"
    out.write_text(json.dumps({"method": "ar", "batch_size": 1, "id": 1, "model": tiny_chat_model, "dtype": "float32",
                               "max_new_tokens": 99, "chat": True, "token_ids": [1]}) + "\n")
    code, _, err = run(capsys, "--model", tiny_chat_model, "--prompts", questions, "--output", out, "--resume",
                       "--max-new-tokens", 4)
    assert code == 2 and "other settings" in err and "max_new_tokens" in err


@pytest.mark.parametrize("args, message", [
    (["--methods", "ar,bogus"], "unknown method 'bogus'"),
    (["--methods", "early-exit:depth=3"], "method early-exit takes no option 'depth'; its options are max_draft"),
    (["--methods", "eesd:beam_width=2"], "method eesd takes no option 'beam_width'; its options are max_draft"),
    (["--methods", "ar:max_draft=2"], "method ar takes no option 'max_draft'; it takes none"),
    (["--methods", "early-exit:exit_layer"], "bad option 'exit_layer'"),
    (["--methods", "ar,,ngram"], "empty entry"),
    (["--methods", "ngram,ngram"], "names 'ngram' twice"),
    (["--methods", "ngram:max_draft=2;max_draft=3"], "method ngram sets max_draft twice"),
    (["--batch-sizes", "1,x"], "bad --batch-sizes"),
    (["--batch-sizes", "0,8"], "bad --batch-sizes"),
    (["--methods", "ar", "--batch-methods", "ngram"], "--batch-methods names ngram"),
    (["--hf", "--batch-size", "2"], "--hf compares at batch size 1"),
    (["--repeats", "0"], "--repeats must be >= 1"),
    (["--prompts", "missing.jsonl"], "prompts file missing.jsonl does not exist"),
    (["--methods", "early-exit:exit_layer=9"],
     "--methods early-exit:exit_layer=9: --exit-layer must be between 1 and 3"),
    (["--methods", "ngram:max_draft=0"], "--methods ngram:max_draft=0: --max-draft must be between 1 and"),
    (["--hf", "--hf-exit-layer", "2"], "--hf-exit-layer goes with --hf-assisted"),
    (["--torch-threads", "1"], "--torch-threads goes with --hf"),
    (["--methods", "ar,ngram", "--batch-methods", "ngram"], "--batch-methods goes with --batch-sizes"),
    (["--section", "more"], "--section goes with --markdown"),
    (["--markdown", "."], "--markdown . is a folder"),
])
def test_bad_input_is_one_line(capsys, tiny_chat_model, questions, tmp_path, args, message):
    base = ["--model", tiny_chat_model, "--output", tmp_path / "o.jsonl"]
    if "--prompts" not in args:
        base += ["--prompts", questions]
    code, out, err = run(capsys, *base, *args)
    assert code == 2 and out == ""
    assert err.startswith("jspec: error: ") and err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "o.jsonl").exists()


def test_output_is_never_the_prompts_file(capsys, tiny_chat_model, questions):
    before = questions.read_text()
    code, out, err = run(capsys, "--model", tiny_chat_model, "--prompts", questions, "--output", questions)
    assert code == 2 and err.startswith("jspec: error: ") and "is the --prompts file" in err, err
    assert questions.read_text() == before


def test_parse_methods():
    specs = parse_methods("early-exit:exit_layer=20;max-draft=6,"
                                "layer-skip:skip_layers=4,6,8;controller=dv,ngram")
    assert [s.label for s in specs] == ["ar", "early-exit:exit_layer=20;max_draft=6",
                                        "layer-skip:skip_layers=4,6,8;controller=dv", "ngram"]
    assert dict(specs[1].options) == {"exit_layer": 20, "max_draft": 6}
    assert dict(specs[2].options) == {"skip_layers": (4, 6, 8), "controller": "dv"}
    assert dict(parse_methods("layer-skip:skip_layers=5")[1].options) == {"skip_layers": (5,)}
    assert dict(parse_methods("mjsd:accept_threshold=1;head=7")[1].options) == {
        "accept_threshold": 1, "head": "7"}  # an int is a number; a path stays a path
    assert dict(parse_methods("mjsd:tree=true")[1].options) == {"tree": True}
    for text, phrase in [("eesd:max_draft=zero", "max_draft takes an integer, got 'zero'"),
                         ("eesd:max_draft=2.5", "max_draft takes an integer"),
                         ("mjsd:accept_threshold=high", "accept_threshold takes a number"),
                         ("mjsd:tree=1", "tree takes true or false, got 1")]:
        with pytest.raises(JspecError, match=phrase):
            parse_methods(text)
    assert parse_batch_sizes("8, 1") == [1, 8]
    for text in ("8,1,8", "", "1,8,"):
        with pytest.raises(JspecError, match="write distinct positive integers"):
            parse_batch_sizes(text)


def test_markdown_markers_are_checked_before_running(tmp_path):
    from jspec.bench.report import check_markdown

    page = tmp_path / "page.md"
    check_markdown(page)  # absent: the report makes it
    for text in ("x\n<!-- bench:begin -->\nold\n", "<!-- bench:end -->\n<!-- bench:begin -->\n"):
        page.write_text(text)
        with pytest.raises(JspecError, match="without the other after it"):
            check_markdown(page)
    page.write_text(OUTER)
    check_markdown(page)
    check_markdown(page, "other")  # a section not there yet goes at the end


def test_prompt_files(tmp_path):
    jspec_file = tmp_path / "p.jsonl"
    # A raw U+2028 (line separator) inside a string is not a line break of the file.
    jspec_file.write_text('{"id": "a", "prompt": "hi\u2028there", "category": "x"}\n\n'
                          '{"prompt": "yo"}\n{"prompt": "z"}\n', encoding="utf-8")
    got = read_bench_prompts(jspec_file, limit=1)
    assert [(p["id"], p["category"]) for p in got] == [("a", "x"), (1, "all")]
    assert got[0]["prompt"] == "hi\u2028there"
    spec = tmp_path / "s.jsonl"
    spec.write_text(json.dumps({"question_id": 7, "category": "qa", "turns": []}) + "\n")
    with pytest.raises(JspecError, match="turns"):
        read_bench_prompts(spec)


def test_machine_info_needs_neither_torch_nor_transformers(monkeypatch):
    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    monkeypatch.setitem(sys.modules, "torch", None)
    info = bench_report.machine_info()
    assert not {"torch", "torch_threads", "transformers"} & set(info) and info["jax"]
    assert bench_report.libraries(info) == ""
    assert bench_report.libraries({"torch": "2.13.0", "torch_threads": 2, "transformers": "5.23.0"}) == \
        ", torch 2.13.0 (2 threads), transformers 5.23.0"


def test_accelerator_script_runs_every_method():
    """Its default --methods names every method jspec has, each once, with its defaults; the
    others are prompt lookup in front of one of them, or a head's top 4 side by side."""
    line = next(x for x in ACCELERATOR_SH.read_text().splitlines() if x.startswith("METHODS="))
    default = re.fullmatch(r'METHODS=\$\{METHODS:-"(.*)"\}', line).group(1)
    specs = parse_methods(default.replace("$DRAFT", "build/draft"))
    plain = [s for s in specs if s.name == "draft" or not s.options]
    assert sorted(s.name for s in plain) == sorted(methods.METHODS)
    assert [s.options for s in plain if s.name != "draft"] == [()] * (len(plain) - 1)
    others = [s for s in specs if s not in plain]
    variants = {(("lookup", 2),): methods.TAKES["lookup_draft"], (("candidates", 4),): methods.TAKES["candidates"]}
    assert others and all(s.name in variants.get(s.options, ()) for s in others)
    assert {s.options for s in others} == set(variants)


@pytest.mark.slow  # about 30 s on 2 cores: 3 methods x 2 batch sizes compile
def test_accelerator_script_on_cpu(tiny_chat_model, tmp_path):
    """benchmarks/accelerator.sh shrunk by its environment (the tiny model, three methods, one with
    an option in its label, 2 prompts, 3 tokens): the page names the device and the date and has a
    row for every method at batch 1 and 8."""
    bindir = Path(sys.executable).parent
    if shutil.which("jspec", path=str(bindir)) is None:
        pytest.skip(f"no jspec script beside {sys.executable} for benchmarks/accelerator.sh to run")
    model = api.load(tiny_chat_model)
    vocab = np.arange(model.cfg.vocab_size, dtype=np.int32)
    head = heads.save(tmp_path / "kangaroo", heads.init(model.params, model.cfg, "kangaroo", 2, vocab),
                      {"kind": "kangaroo", "exit_layer": 2, "model": fingerprint(model.cfg)})
    labels = ["ar", f"kangaroo:head={head}", "ngram"]
    prompts, page = tmp_path / "prompts.jsonl", tmp_path / "docs" / "accelerator.md"
    prompts.write_text('{"prompt": "Name three primes."}\n{"prompt": "Describe a cat.", "category": "x"}\n')
    env = {**os.environ, "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}", "MODEL": tiny_chat_model,
           "METHODS": ",".join(labels), "PROMPTS": str(prompts), "LIMIT": "", "MAX_NEW_TOKENS": "3",
           "OUTPUT": str(tmp_path / "results.jsonl"), "PAGE": str(page)}
    proc = subprocess.run(["bash", str(ACCELERATOR_SH)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = page.read_text()
    assert f"({jax.devices()[0].device_kind})" in text and re.search(r"\d{4}-\d\d-\d\d \d\d:\d\d UTC", text)
    assert "## Results: accelerator" in text and "(bfloat16)" in text
    assert "| method | batch 1 | batch 8 | mismatches |" in text
    for label in labels:  # in the overall table (both prompts) and the batch table, with no mismatch
        row = rf"^\| `{re.escape(label)}` \| "
        assert re.search(row + r"2 \| .* \| 0 \|$", text, re.M), label
        assert re.search(row + r"[\d.]+ \([\d.]+x\) \| [\d.]+ \([\d.]+x\) \| 0 \|$", text, re.M), label
    assert (page.parent / "img" / "accelerator" / bench_report.THROUGHPUT_PNG).is_file()


def test_steady_run_repeats_only_a_run_that_compiled():
    class Fake:  # programs() grows on the first call only, as a new prompt bucket's would
        def __init__(self):
            self.compiled = {}

        def programs(self):
            return dict(self.compiled)

    model, calls = Fake(), []

    def run():
        calls.append(len(calls))
        model.compiled.setdefault("bucket", object())
        return len(calls)

    assert steady_run(model, run) == 2  # the second run is the one returned
    assert steady_run(model, run) == 3 and calls == [0, 1, 2]


def test_speedup_interval_brackets_the_ratio():
    """The overall table's 95% interval resamples the questions, the same draw for both methods:
    a method twice as fast on every question gets exactly 2-2x; uneven per-question ratios give
    an interval around the point speedup that narrows as questions are added."""
    def report(ratios):
        prompts = [{"id": i, "category": "c"} for i in range(len(ratios))]
        rows = [{"id": i, "method": m, "batch_size": 1, "tokens_per_second": (10.0 + i) * (r if m == "x" else 1)}
                for i, r in enumerate(ratios) for m in ("ar", "x")]
        return bench_report.Report(rows, prompts, ["ar", "x"], [], [1], "", {}, "", None)

    even = report([2.0] * 5)
    ids = even._ids()
    assert even.speedup_interval("x", 1, ids) == pytest.approx((even.speedup("x", 1, ids),) * 2)
    assert report([1.0, 2.0]).speedup_interval("x", 1, [json.dumps(0), json.dumps(1)]) is None  # too few
    rng = np.random.default_rng(1)
    widths = []
    for n in (8, 64):
        r = report(rng.uniform(0.5, 3.0, n).tolist())
        lo, hi = r.speedup_interval("x", 1, r._ids())
        assert lo < r.speedup("x", 1, r._ids()) < hi
        widths.append(hi - lo)
    assert widths[1] < widths[0]


def test_nll_interval_brackets_the_change():
    """The quality table's interval of "NLL vs ar" resamples the questions: a method 10% above ar's
    NLL on every question gets exactly +10% to +10%; per-question changes of either sign give an
    interval around the pooled change that contains 0 when the signs balance."""
    def report(factors):
        prompts = [{"id": i, "category": "c"} for i in range(len(factors))]
        rows = [{"id": i, "method": m, "batch_size": 1, "tokens_per_second": 1.0, "nll_tokens": 100 + i,
                 "nll_sum": (100 + i) * 0.5 * (f if m == "x" else 1)}
                for i, f in enumerate(factors) for m in ("ar", "x")]
        return bench_report.Report(rows, prompts, ["ar", "x"], [], [1], "", {}, "", None)

    even = report([1.1] * 5)
    assert even.nll_interval("x", 1, even._ids()) == pytest.approx((0.1, 0.1))
    assert "| +10.0% | +10.0% to +10.0% |" in even.quality_table()
    mixed = report([0.7, 1.3] * 6)
    nll, ar_nll, _, _ = mixed.quality("x", 1, mixed._ids())
    lo, hi = mixed.nll_interval("x", 1, mixed._ids())
    assert lo < nll / ar_nll - 1 < hi and lo < 0 < hi
    two = report([1.1, 1.2])
    assert two.nll_interval("x", 1, two._ids()) is None  # too few questions
