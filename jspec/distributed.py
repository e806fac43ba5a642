"""Multi-process runs: a TPU pod's hosts, GPU hosts, or several processes on one machine.

Every process runs the same program (SPMD) through `jax.distributed`: `initialize` joins the run,
after which `jax.devices()` lists every process's devices, so a `--mesh` spans them all and jit
places each row of a batch on the process whose devices hold it. jspec adds only what the CLI
needs around that: checks that turn a bad setup into one line instead of a hang or an abort, and
the three transfers of a generation run (`rows_array`, `gather`, `from_writer`).

    process 0:  jspec generate ... --coordinator HOST:PORT --num-processes 2 --process-id 0
    process 1:  jspec generate ... --coordinator HOST:PORT --num-processes 2 --process-id 1
    TPU pod:    jspec generate ... --distributed          (every worker; the pod supplies the rest)
"""

from __future__ import annotations

import hashlib
import os
import socket
import sys
import threading
import time

import jax
import numpy as np
from jax.experimental import multihost_utils

from jspec.errors import JspecError


def initialize(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None,
               *, auto: bool = False, timeout: int = 300) -> None:
    """Join a multi-process run, before anything else touches jax's devices.

    Explicit: all of coordinator ('HOST:PORT', process 0's address), num_processes and process_id.
    auto=True: nothing else; jax reads them from the environment (a TPU pod, Slurm, Open MPI).
    Waits at most `timeout` seconds for the other processes.
    """
    given = [x is not None for x in (coordinator, num_processes, process_id)]
    if auto and any(given):
        raise JspecError("--distributed detects the setup; give it alone, or --coordinator, --num-processes "
                         "and --process-id without it")
    if not auto and not all(given):
        raise JspecError("a multi-process run needs all of --coordinator HOST:PORT, --num-processes N and "
                         "--process-id I (or --distributed on a TPU pod)")
    if not auto:
        if num_processes < 1:
            raise JspecError(f"--num-processes must be >= 1, got {num_processes}")
        if not 0 <= process_id < num_processes:
            raise JspecError(f"--process-id must be in 0..{num_processes - 1} for --num-processes "
                             f"{num_processes}, got {process_id}")
        host, port = _address(coordinator)
    if jax.distributed.is_initialized():
        raise JspecError("jax.distributed is already initialized in this process")
    # Collectives between CPU processes (the two-process test, CPU hosts) go through gloo; GPU and
    # TPU programs use their own and ignore this.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if auto:
        try:
            jax.distributed.initialize(initialization_timeout=timeout)
        except ValueError as e:  # jax found no cluster in the environment
            raise JspecError(f"--distributed found no multi-process setup here ({e}); give --coordinator, "
                             "--num-processes and --process-id") from None
        return
    if process_id != 0:
        # jax's client aborts the process (a C++ fatal error with a stack trace) when no coordinator
        # answers within the timeout: find out first, and say so in one line.
        _wait_for(host, port, timeout)
    # jax's own deadline aborts the process (a C++ fatal error) when some process never arrives, so
    # a watchdog gives up first, in one line; jax's deadline stays as the backstop.
    watchdog = threading.Timer(timeout, _give_up, [f"not all {num_processes} processes joined the run at "
                                                   f"{coordinator} within {timeout:g} s (were they all started, "
                                                   f"with the same --num-processes?)"])
    watchdog.daemon = True
    watchdog.start()
    try:
        jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                                   process_id=process_id, initialization_timeout=timeout + 30)
    finally:
        watchdog.cancel()
    # jax takes the process count from the coordinator: a process started with another count joins
    # without complaint, and would wait forever in the first collective that counts on it.
    counts = multihost_utils.process_allgather(np.asarray([num_processes]))
    if np.any(counts != jax.process_count()):
        raise JspecError(f"the processes disagree on --num-processes ({', '.join(map(str, counts.ravel()))} "
                         f"by process id); the coordinator expects {jax.process_count()}")


def _give_up(message: str) -> None:
    """A clean exit from a thread while the main thread is stuck inside jax's C++ (no exception
    can reach it there): the CLI's one-line error and exit status 2."""
    print(f"jspec: error: {message}", file=sys.stderr, flush=True)
    os._exit(2)


def _address(coordinator: str) -> tuple[str, int]:
    host, sep, port = coordinator.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise JspecError(f"--coordinator must be HOST:PORT, got {coordinator!r}")
    return host, int(port)


def _wait_for(host: str, port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((host, port), timeout=min(5.0, timeout)).close()
            return
        except OSError:
            if time.monotonic() >= deadline:
                raise JspecError(f"no coordinator answered at {host}:{port} within {timeout:g} s "
                                 f"(is process 0 running, and is the address right?)") from None
            time.sleep(0.5)


def is_writer() -> bool:
    """Process 0 writes outputs and prints; the others compute their rows and stay quiet."""
    return jax.process_index() == 0


def rows_array(x: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
    """A global array of host data every process holds (the batch's tokens, say), each process
    putting only the pieces its own devices hold."""
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def gather(tree):
    """A pytree of global arrays as NumPy on every process (the rows other hosts computed too)."""
    if jax.process_count() == 1:
        return jax.device_get(tree)
    return multihost_utils.process_allgather(tree, tiled=True)


def from_writer(value: np.ndarray) -> np.ndarray:
    """Process 0's `value` on every process (what an interrupted run already wrote, say)."""
    if jax.process_count() == 1:
        return value
    return np.asarray(multihost_utils.broadcast_one_to_all(value))


def check_same(what: str, text: str) -> None:
    """Fail on every process when the processes were not given the same `what` (their prompts or
    options): SPMD processes running different batches would wait on each other forever."""
    if jax.process_count() == 1:
        return
    digest = np.frombuffer(hashlib.sha256(text.encode()).digest()[:8], np.int64)
    digests = multihost_utils.process_allgather(digest).ravel()
    if np.any(digests != digests[0]):
        differ = [i for i, d in enumerate(digests) if d != digests[0]]
        raise JspecError(f"process(es) {', '.join(map(str, differ))} were given other {what} than process 0; "
                         f"every process must run the same command apart from --process-id")
