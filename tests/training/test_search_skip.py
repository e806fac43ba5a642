"""jspec search-skip's bookkeeping: the trial log, resuming after an interruption, and refusing a
log of another search. The sampler and the objective are stand-ins (no model, no Optuna)."""

from __future__ import annotations

import json

import pytest

from jspec.errors import JspecError
from jspec.parts import knn
from jspec.training import search_skip as skip_search

VARIABLES = skip_search.names(3)


class Counting:
    """Proposes the trials in order (trial i skips the sublayers of i's bits); remembers what it was told."""

    def __init__(self):
        self.told, self.replayed, self.i = [], [], 0

    def replay(self, done):
        self.replayed = list(done)
        self.i = len(done)

    def ask(self):
        params = {v: (self.i >> b) & 1 for b, v in enumerate(VARIABLES)}
        self.i += 1
        return params

    def tell(self, value):
        self.told.append(value)


def objective(calls, stop_at=None):
    def run(params):
        if len(calls) == stop_at:
            raise KeyboardInterrupt
        calls.append(params)
        return float(sum(params.values())), {"mean_accepted_tokens": 1.0}

    return run


def test_resume_continues_where_it_stopped(tmp_path):
    log, header = tmp_path / "qa.trials.jsonl", {"prompts": "qa", "ids": [1, 2]}
    first = []
    with pytest.raises(KeyboardInterrupt):
        skip_search.search(objective(first, stop_at=3), Counting(), VARIABLES, 8, log, header)
    assert len(first) == 3
    assert len(log.read_text().splitlines()) == 1 + 3  # the header, then one line per finished trial

    again, proposer, seen = [], Counting(), []
    trials = skip_search.search(objective(again), proposer, VARIABLES, 8, log, header,
                                report=lambda i, row, best: seen.append((i, best[1])))
    assert [p for p, _ in proposer.replayed] == first  # the finished trials are told, not rerun
    assert len(again) == 5 and [i for i, _ in seen] == [3, 4, 5, 6, 7]
    assert [t[0] for t in trials] == first + again
    best = max(trials, key=lambda t: t[1])
    assert seen[-1][1] == best[1]
    rows = [json.loads(x) for x in log.read_text().splitlines()[1:]]
    assert [r["trial"] for r in rows] == list(range(8))
    # Done: rerunning runs nothing.
    more = []
    assert len(skip_search.search(objective(more), Counting(), VARIABLES, 8, log, header)) == 8 and more == []


def test_fit_knn_refuses_an_out_folder_of_something_else(capsys, tmp_path):
    from jspec.cli import main

    (tmp_path / "qa.json").write_text(json.dumps(knn.SkipSet("qa", (1,), ()).to_json()))
    assert main(["fit-knn", "--sets", str(tmp_path), "--out", str(tmp_path), "--model", "/no/such/model"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("jspec: error:") and "no knn.json" in err and len(err.splitlines()) == 1
    assert [p.name for p in tmp_path.iterdir()] == ["qa.json"]


def test_log_of_another_search_refused(tmp_path):
    log = tmp_path / "qa.trials.jsonl"
    skip_search.search(objective([]), Counting(), VARIABLES, 2, log, {"prompts": "qa"})
    with pytest.raises(JspecError, match="another search"):
        skip_search.search(objective([]), Counting(), VARIABLES, 4, log, {"prompts": "rag"})


def test_params_round_trip():
    s = knn.SkipSet("x", (0, 2), (1,))
    params = skip_search.to_params(s, 3)
    assert sorted(params) == sorted(VARIABLES)
    back = skip_search.to_set("x", params, 3)
    assert (back.attention, back.mlp) == (s.attention, s.mlp)
    assert s.mask(3).tolist() == [[True, False, True], [False, True, False]]
    with pytest.raises(JspecError, match="skip set x names layers outside 0..1"):
        s.mask(2)
    with pytest.raises(JspecError, match="skip set all skips every layer"):
        knn.SkipSet("all", (0, 1), (1, 0)).mask(2)


def test_fit_knn_refuses_a_set_of_other_layers(capsys, tmp_path, tiny_llama):
    from jspec.cli import main

    (tmp_path / "qa.json").write_text(json.dumps(knn.SkipSet("qa", (1, 99), ()).to_json()))
    out = tmp_path / "k"
    assert main(["fit-knn", "--sets", str(tmp_path), "--out", str(out), "--model", str(tiny_llama.path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"jspec: error: skip set qa names layers outside 0..{tiny_llama.cfg.num_layers - 1}"
    assert not out.exists()


@pytest.mark.parametrize("argv, message", [
    (["generate", "hi", "--knn", "x"], "--knn does not go with --method ar"),
    (["search-skip", "--prompts", "missing.jsonl", "--out", "o.json"], "does not exist"),
    (["search-skip", "--prompts", "train_prompts", "--category", "nope", "--out", "o.json"], "no prompts of category"),
    (["fit-knn", "--sets", ".", "--out", "o"], "holds no skip sets"),
    (["fit-knn", "--sets", "sets", "--out", "o", "--centres", "0"], "--count and --centres must be >= 1"),
    (["fit-knn", "--sets", "sets", "--out", "o"], "sets/x.json is not a skip set"),
    (["fit-knn", "--sets", "sets", "--out", "o", "--no-anchors", "y"], "--no-anchors names every set"),
    (["generate", "hi", "--method", "layer-skip", "--skip-layers", ",", "--model", "missing"],
     "--skip-layers names no layer"),
    (["search-skip", "--prompts", "domains/qa", "--out", "sets"], "must name a .json file"),
    (["search-skip", "--prompts", "domains/qa", "--out", "sets/x.json"], "sets/x.json is not a skip set"),
])
def test_cli_errors_are_one_line(argv, message, capsys, tmp_path, monkeypatch):
    from jspec.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "sets").mkdir()
    (tmp_path / "sets" / "x.json").write_text('{"attention": [1]}')
    if "--no-anchors" in argv:
        (tmp_path / "sets" / "x.json").write_text(json.dumps(knn.SkipSet("y", (1,), ()).to_json()))
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("jspec: error:") and message in err and len(err.splitlines()) == 1
    assert [p.name for p in tmp_path.iterdir()] == ["sets"]  # no output file, not even half of one
