"""benchmarks/device_check.py's dry run: the full run's measurements, on tiny random models on this
CPU. Its rows, the page section between its markers, and the budget that keeps it to a lease."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "device_check.py"
OUTER = "# Benchmarks on an accelerator\n\nintro\n\n<!-- device-check:begin -->\nold\n<!-- device-check:end -->\n\noutro\n"


@pytest.fixture(scope="module")
def device_check():
    spec = importlib.util.spec_from_file_location("device_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # where its dataclass looks itself up
    spec.loader.exec_module(module)
    return module


def run(device_check, tmp_path, *extra) -> tuple[list[dict], str]:
    page = tmp_path / "page.md"
    page.write_text(OUTER)
    out = tmp_path / "rows.jsonl"
    assert device_check.main(["--dry-run", "--output", str(out), "--page", str(page), "--new-tokens", "8",
                              "--prompt-tokens", "16", "--long-prompt-tokens", "40", *extra]) == 0
    return [json.loads(line) for line in out.read_text().splitlines()], page.read_text()


@pytest.mark.slow
def test_dry_run_measures_what_the_full_run_does(device_check, tmp_path):
    rows, page = run(device_check, tmp_path)
    big = [r for r in rows if r["part"] == "ar"]
    assert [(r["dtype"], r["activation_dtype"], r["kv_cache_dtype"], r["batch"]) for r in big] == [
        (d, n.activations, n.kv_cache, b) for d, n, b in device_check.BIG_RUNS]
    for r in big:
        assert r["tokens_per_s"] > 0 and r["new_tokens"] == 8 * r["batch"]
        assert isinstance(r["weight_copies"], int) and isinstance(r["cache_relayouts"], int)
        assert r["matmul_precision"] == ("highest" if r["activation_dtype"] == "float32" else "default")
    # The program's arguments hold the cache: half of it in bfloat16.
    at32 = {r["kv_cache_dtype"]: r["memory"]["argument_size_in_bytes"] for r in big
            if r["batch"] == 32 and r["dtype"] == "bfloat16"}
    assert at32["bfloat16"] < at32["float32"]
    # int8 weights: about half the arguments of bfloat16's at the same batch and numerics.
    at1 = {r["dtype"]: r["memory"]["argument_size_in_bytes"] for r in big
           if r["batch"] == 32 and r["activation_dtype"] == "bfloat16"}
    assert at1["int8"] < at1["bfloat16"]
    attention = [r for r in rows if r["part"] == "attention"]
    assert [(r["kernel"], r["batch"], r["prompt_tokens"]) for r in attention] == [
        (True, device_check.ATTENTION_BATCH, 40), (False, device_check.ATTENTION_BATCH, 40)]
    assert all(r["identical_rows"] == r["rows"] and r["tokens_per_s"] > 0 for r in attention)
    assert "| attention kernel |" in page
    int8 = [r for r in rows if r["part"] == "int8"]  # this CPU runs XLA's product either way: the plumbing
    assert [(r["kernel"], r["dtype"], r["batch"]) for r in int8] == [(True, "int8", 1), (False, "int8", 1)]
    assert all(r["identical_rows"] == r["rows"] and r["tokens_per_s"] > 0 for r in int8)
    assert "| int8 kernel |" in page
    spec = [r for r in rows if r["part"] == "methods"]
    assert [(r["method"], r["batch"]) for r in spec] == [
        (m, b) for b in device_check.METHOD_BATCHES for m in device_check.METHODS]
    assert all(r["identical_rows"] == r["rows"] == 8 for r in spec)  # every method is lossless
    assert page.startswith("# Benchmarks on an accelerator\n\nintro\n\n<!-- device-check:begin -->\n")
    assert page.endswith("<!-- device-check:end -->\n\noutro\n") and "old" not in page
    assert page.count("| `eagle` |") == len(device_check.METHOD_BATCHES) and "Left out" not in page


def test_nothing_starts_past_the_budget(device_check, tmp_path):
    rows, page = run(device_check, tmp_path, "--budget", "0")
    assert [r["part"] for r in rows] == ["run"]
    assert "Left out, past the 0 s budget: `ar` on the tiny (dry run) model, bfloat16 weights, batch 1" in page


def test_a_page_from_parts_run_apart(device_check, tmp_path):
    """Two leases (or two calls), a part each: --report writes the page both would have made."""
    big, _ = run(device_check, tmp_path, "--part", "big", "--budget", "0")
    (tmp_path / "big.jsonl").write_text((tmp_path / "rows.jsonl").read_text())
    rows = [{"part": "methods", "model": "m", "dtype": "bfloat16", "method": "ngram", "batch": 8,
             "tokens_per_s": 9.0, "speedup": 1.5, "identical_rows": 8, "rows": 8, "compile_s": 1.0,
             "device": "X (gpu)"}, {**big[-1], "command": "second"}]
    (tmp_path / "methods.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    page = tmp_path / "page.md"
    assert device_check.main(["--report", str(tmp_path / "big.jsonl"), str(tmp_path / "methods.jsonl"),
                              "--page", str(page)]) == 0
    text = page.read_text()
    assert "## Device check: X (gpu)" in text and "| `ngram` | bfloat16 | 8 | 9.0 | 1.5x | 8/8 | 1.0 |" in text
    assert "--part big --budget 0`" in text and "`second`" in text
