"""Multi-process generation through jax.distributed: two real processes on this machine, each
with 4 simulated CPU devices and gloo collectives, one data=2,model=4 mesh across them.

What a pod does, shrunk: the two-process run writes what the one-process run on the same mesh
writes, a resumed two-process run loses nothing, and bad setups end in one line.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import TINY

from jspec import cli

pytestmark = pytest.mark.slow  # each run starts two Python processes that compile the loop
MESH = "data=2,model=4"
ARGS = ["--mesh", MESH, "--batch-size", "4", "--max-new-tokens", "12", "--method", "ngram"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def four_devices() -> dict:
    """This environment with 4 simulated CPU devices a process, not conftest's 8 (its other XLA
    flags, the suite's cheaper compiling, kept)."""
    flags = os.environ["XLA_FLAGS"].replace("--xla_force_host_platform_device_count=8",
                                            "--xla_force_host_platform_device_count=4")
    assert "device_count=4" in flags, flags
    return {**os.environ, "XLA_FLAGS": flags}


def launch(model, *argv, num=(2, 2), timeout=240, only=None, init_timeout=60, caches=None, file_limit=None):
    """Run `jspec generate argv` as processes 0 and 1 (or `only` one of them) of one run, each
    with JSPEC_CACHE caches[i] if given, process 0's files limited to `file_limit` bytes if given
    (its writes past it fail, as on a full disk); returns [(returncode, stderr)] by process id."""
    # set by a Python that then becomes process 0 (exec keeps the limit): no fork of a threaded pytest
    limited = [] if file_limit is None else [
        "-c", f"import os, resource, sys; resource.setrlimit(resource.RLIMIT_FSIZE, ({file_limit}, {file_limit})); "
              "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"]
    env = four_devices()
    coordinator = f"localhost:{free_port()}"
    procs = [subprocess.Popen([sys.executable, *(limited if i == 0 else []), "-m", "jspec.cli", "generate",
                               *map(str, argv), "--model", str(model), "--coordinator", coordinator,
                               "--num-processes", str(num[i]), "--process-id", str(i),
                               "--init-timeout", str(init_timeout)],
                              env=env if caches is None else {**env, "JSPEC_CACHE": str(caches[i])},
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for i in (range(2) if only is None else [only])]
    try:
        return [(p.wait(timeout=timeout), p.stderr.read()) for p in procs]
    finally:
        for p in procs:
            p.kill()


def records(path):
    return {r["id"]: r["token_ids"] for r in map(json.loads, path.read_text().splitlines())}


@pytest.fixture(scope="module")
def setup(tiny_llama, tmp_path_factory):
    """The tiny model's folder, a prompts file and the one-process output on the same mesh."""
    tmp = tmp_path_factory.mktemp("distributed")
    rng = np.random.default_rng(3)
    prompts = tmp / "in.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "token_ids": rng.integers(3, TINY["vocab_size"], n).tolist()})
                               + "\n" for i, n in enumerate([5, 17, 9, 30, 12, 3, 22])))
    reference = tmp / "one.jsonl"
    assert cli.main(["generate", "--prompts", str(prompts), "--output", str(reference), "--model",
                     str(tiny_llama.path), *ARGS]) == 0
    return tiny_llama.path, prompts, records(reference)


@pytest.mark.parametrize("shared", [True, False], ids=["one-cache", "a-cache-each"])
def test_two_processes_write_what_one_writes(setup, tmp_path, shared):
    """Two processes write what one writes, given the HF folder itself: on one shared cache folder
    one converts while the other waits, on two (local disks) each converts. (A resumed run:
    test_a_failure_mid_run_ends_both_and_keeps_the_records.)"""
    model, prompts, reference = setup
    source = model.parent / "source"  # the HF folder the tiny model was converted from
    caches = [tmp_path / "cache"] * 2 if shared else [tmp_path / "cache0", tmp_path / "cache1"]
    out = tmp_path / "two.jsonl"
    results = launch(source, "--prompts", prompts, "--output", out, *ARGS, caches=caches)
    assert [rc for rc, _ in results] == [0, 0], results
    assert list(records(out).items()) == list(reference.items())  # every record once, in prompt order
    assert not (tmp_path / "two.jsonl.partial").exists()
    converting = [err.count("converting ") for _, err in results]
    assert converting == ([1, 0] if shared else [1, 1]) or (shared and converting == [0, 1]), results
    for cache in set(caches):
        assert [p.name.split("-")[0] for p in cache.iterdir() if not p.name.startswith(".")] == ["source"]


def one_line_error(rc, err, phrase, status=2):
    lines = [line for line in err.splitlines() if line.startswith("jspec: ")]
    assert rc == status and "Traceback" not in err and len(lines) == 1 and phrase in lines[0], err


def test_no_coordinator_is_one_line(setup, tmp_path):
    model, prompts, _ = setup
    t0 = time.monotonic()
    [(rc, err)] = launch(model, "--prompts", prompts, "--output", tmp_path / "o.jsonl", *ARGS[:2], only=1, init_timeout=5)
    one_line_error(rc, err, "no coordinator answered at localhost:")
    assert time.monotonic() - t0 < 60
    assert not (tmp_path / "o.jsonl").exists()


def test_distributed_without_a_cluster_is_one_line(setup, tmp_path):
    """--distributed on a machine with no multi-process setup for jax to detect."""
    model, prompts, _ = setup
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "OMPI_", "TPU_", "MEGASCALE_", "JAX_COORDINATOR"))}
    p = subprocess.run([sys.executable, "-m", "jspec.cli", "generate", "--prompts", str(prompts), "--output",
                        str(tmp_path / "o.jsonl"), "--model", str(model), "--distributed", "--mesh", "data=1",
                        "--init-timeout", "5"], env=env, capture_output=True, text=True, timeout=120)
    one_line_error(p.returncode, p.stderr, "--distributed found no multi-process setup here")
    assert not (tmp_path / "o.jsonl").exists()


def test_mismatched_process_counts_are_one_line(setup, tmp_path):
    model, prompts, _ = setup
    results = launch(model, "--prompts", prompts, "--output", tmp_path / "o.jsonl", *ARGS[:2], num=(2, 3))
    for rc, err in results:
        one_line_error(rc, err, "disagree on --num-processes")


def test_a_missing_process_is_one_line(setup, tmp_path):
    """Both started with --num-processes 3, and the third never comes."""
    model, prompts, _ = setup
    t0 = time.monotonic()
    results = launch(model, "--prompts", prompts, "--output", tmp_path / "o.jsonl", *ARGS[:2], num=(3, 3),
                     init_timeout=5)
    for rc, err in results:
        one_line_error(rc, err, "not all 3 processes joined the run")
    assert time.monotonic() - t0 < 60


def test_different_commands_are_one_line(setup, tmp_path):
    model, prompts, _ = setup
    other = tmp_path / "other.jsonl"
    other.write_text(prompts.read_text().replace('"p0"', '"q0"'))
    env = four_devices()
    coordinator = f"localhost:{free_port()}"
    procs = [subprocess.Popen([sys.executable, "-m", "jspec.cli", "generate", "--prompts", str(p), "--output",
                               str(tmp_path / "o.jsonl"), "--model", str(model), *ARGS[:2], "--coordinator",
                               coordinator, "--num-processes", "2", "--process-id", str(i)],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for i, p in enumerate([prompts, other])]
    try:
        results = [(p.wait(timeout=240), p.stderr.read()) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for rc, err in results:
        one_line_error(rc, err, "were given other prompts than process 0")


def test_a_process_failing_after_the_join_ends_both(setup, tmp_path):
    """Process 0 alone refuses the output, once both have joined: process 1, waiting for it in
    a broadcast, ends too, at once, saying why."""
    model, prompts, _ = setup
    out = tmp_path / "o.jsonl"
    out.mkdir()
    t0 = time.monotonic()
    [(rc0, err0), (rc1, err1)] = launch(model, "--prompts", prompts, "--output", out, *ARGS, timeout=90)
    one_line_error(rc0, err0, f"output {out} is a directory")
    one_line_error(rc1, err1, f"process 0 failed: output {out} is a directory")
    assert time.monotonic() - t0 < 60  # jax's shutdown barrier alone would hold process 0 for 300 s


def test_a_failure_mid_run_ends_both_and_keeps_the_records(setup, tmp_path):
    """Process 0's disk fills up at its third record, while process 1 computes on: both end in one
    line; the first two records stay whole in the partial file, and --resume completes the run."""
    model, prompts, reference = setup
    out = tmp_path / "two.jsonl"
    args = ["--prompts", prompts, "--output", out, *ARGS[:2], "--batch-size", "2", *ARGS[4:]]
    # a record of the tiny model is about 410 bytes: two fit, the third does not
    [(rc0, err0), (rc1, err1)] = launch(model, *args, file_limit=1200, timeout=120)
    one_line_error(rc0, err0, "File too large", status=1)
    one_line_error(rc1, err1, "File too large", status=1)
    assert "jspec: error: process 0 failed: " in err1
    lines = (tmp_path / "two.jsonl.partial").read_text().split("\n")[:-1]  # the last piece is torn, or empty
    kept = {r["id"]: r["token_ids"] for r in map(json.loads, lines)}
    # which two depends on the order rows finish in (continuous batching writes each as it ends)
    assert len(kept) == 2 and all(kept[i] == reference[i] for i in kept)
    assert not out.exists()
    results = launch(model, *args, "--resume")
    assert [rc for rc, _ in results] == [0, 0], results
    assert "resuming: 2 of 7 prompts" in results[0][1]
    assert records(out) == reference
