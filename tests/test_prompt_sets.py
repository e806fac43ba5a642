"""The prompt sets jspec ships: the defaults of `jspec bench` and `jspec distill-data` resolve to
package data and load from any working directory, and the readers take gzip-compressed files.
What ships for the default model (heads, predictors, ...) is package data too."""

from __future__ import annotations

import gzip
import json
import tomllib
from pathlib import Path

import pytest

import jspec
from jspec import prompt_sets
from jspec.bench.specs import read_bench_prompts
from jspec.cli import main
from jspec.cli.main import build_parser
from jspec.errors import JspecError
from jspec.jsonl import read_prompts
from jspec.parts import shipped

ROWS = {"spec_bench": 480, "train_prompts": 13931, "domains/translation": 2000, "domains/summarization": 1092,
        "domains/qa": 2000, "domains/text_to_sql": 1990, "domains/story_writing": 1500, "domains/rag": 1136}


@pytest.fixture(autouse=True)
def _elsewhere(tmp_path, monkeypatch):
    """Run from a directory with no checkout and no ../shared beside it."""
    monkeypatch.chdir(tmp_path)


def test_every_set_loads_from_any_directory():
    assert set(prompt_sets.SETS) == set(ROWS)
    for name, rows in ROWS.items():
        source = prompt_sets.resolve(name)
        assert source.is_file() and source.name.endswith(".jsonl.gz"), source
        prompts = read_bench_prompts(source)
        assert len(prompts) == rows, name
        assert all(p["prompt"].strip() for p in prompts)
        if name != prompt_sets.SPEC_BENCH:
            assert len(read_prompts(source)) == rows


def test_spec_bench_is_the_published_question_file():
    prompts = read_bench_prompts(prompt_sets.resolve("spec_bench"), limit=1)
    assert len(prompts) == 13 == len({p["category"] for p in prompts})  # one question of each category
    assert prompts[0]["id"] == 81 and prompts[0]["category"] == "writing"


@pytest.mark.parametrize("command, default", [("bench", "spec_bench"), ("distill-data", "train_prompts")])
def test_defaults_are_shipped_sets(capsys, command, default):
    args = build_parser().parse_args([command, "--out" if command == "distill-data" else "--output", "o"])
    # distill-data takes several sets (its default, one); bench one.
    [given] = args.prompts if command == "distill-data" else [args.prompts]
    assert given == default and prompt_sets.resolve(given).is_file()
    assert main([command, "--help"]) == 0
    help_text = capsys.readouterr().out
    assert "shared" not in help_text and default in help_text


def test_gzip_prompts_and_a_bad_gzip_file(tmp_path):
    good = tmp_path / "in.jsonl.gz"
    good.write_bytes(gzip.compress(b'{"id": "a", "prompt": "hi"}\n{"prompt": "yo", "category": "x"}\n'))
    assert read_prompts(good) == [{"id": "a", "prompt": "hi"}, {"id": 1, "prompt": "yo"}]
    assert [p["category"] for p in read_bench_prompts(good)] == ["all", "x"]
    bad = tmp_path / "bad.jsonl.gz"
    bad.write_text(json.dumps({"prompt": "not compressed"}) + "\n")
    with pytest.raises(JspecError, match="bad.jsonl.gz is not a readable gzip file"):
        read_prompts(bad)
    with pytest.raises(JspecError, match="prompts file spec_bench.jsonl does not exist"):
        read_prompts(prompt_sets.resolve("spec_bench.jsonl"))  # a set's name, not its file's


def test_a_byte_order_mark_is_not_part_of_the_first_line(tmp_path):
    """Windows editors start a UTF-8 file with a byte-order mark; the first prompt is still JSON."""
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + b'{"prompt": "hi"}\n{"prompt": "\xc3\xa9t\xc3\xa9"}\n')
    assert read_prompts(path) == [{"id": 0, "prompt": "hi"}, {"id": 1, "prompt": "\u00e9t\u00e9"}]


def test_distill_data_refuses_the_shipped_evaluation_set(capsys, tmp_path):
    assert main(["distill-data", "--prompts", "spec_bench", "--out", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jspec: error: spec_bench is the evaluation set") and err.count("\n") == 1


def test_what_commands_read_by_default_is_package_data():
    """Every file of jspec/data and jspec/checkpoints is in the wheel (pyproject's package-data),
    so a `pip install .` or Colab's `pip install git+...` loads the shipped heads, not only a
    checkout installed with -e."""
    root = Path(jspec.__file__).parent
    pyproject = tomllib.loads((root.parent / "pyproject.toml").read_text())
    packaged = {p for pattern in pyproject["tool"]["setuptools"]["package-data"]["jspec"] for p in root.glob(pattern)}
    files = {p for folder in ("data", "checkpoints") for p in (root / folder).rglob("*") if p.is_file()}
    assert len(files) > 80 and not files - packaged, sorted(str(p.relative_to(root)) for p in files - packaged)
    assert shipped.CHECKPOINTS.parent == root
