"""Multi-process runs: a TPU pod's hosts, GPU hosts, or several processes on one machine.

Every process runs the same program (SPMD) through `jax.distributed`: `initialize` joins the run,
after which `jax.devices()` lists every process's devices, so a `--mesh` spans them all and jit
places each row of a batch on the process whose devices hold it. jspec adds only what the CLI
needs around that: checks that turn a bad setup into one line instead of a hang or an abort, the
three transfers of a generation run (`rows_array`, `gather`, `from_writer`), and `fail`.

A failure on one process ends them all within seconds, each in one line. The failing process (the
CLI's error path calls `fail`) publishes its message in the coordination service's key-value
store and exits, without waiting in jax's shutdown barrier for processes that will never get
there. A watchdog thread on every process, from the join to its exit, reads it at once, prints
`jspec: error: process N failed: MESSAGE` and exits with that process's status, even while its
main thread waits inside a collective. Process 0, which holds the service, leaves last. Records
are fsynced batch by batch, so these abrupt exits lose none (`--resume` continues). A process
killed outright says nothing: jax's client then aborts the others (its C++ fatal error and stack
trace), at once when process 0 was killed, after jax's heartbeat timeout (100 s) otherwise.

    process 0:  jspec generate ... --coordinator HOST:PORT --num-processes 2 --process-id 0
    process 1:  jspec generate ... --coordinator HOST:PORT --num-processes 2 --process-id 1
    TPU pod:    jspec generate ... --distributed          (every worker; the pod supplies the rest)
"""

from __future__ import annotations

import atexit
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

# The run's failure in the coordination service's key-value store: "PROCESS STATUS MESSAGE", set once,
# by the first process that fails. A watchdog that reads it answers under _SEEN + its process id.
_FAILED = "jspec/failed"
_SEEN = "jspec/seen/"
_POLL_MS = 1000
_ACK_S = 5.0  # how long process 0 waits for the others to have read a failure
_LINGER_S = 1.0  # and then for them to exit, before the service goes with it (which jax answers with an abort)
_exiting = threading.Event()  # set at exit: the coordination service's going away is expected then
_last_word = threading.Lock()  # taken for good by the one thread that prints this process's last line


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
        _start_watchdog()
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
    _start_watchdog()
    # jax takes the process count from the coordinator: a process started with another count joins
    # without complaint, and would wait forever in the first collective that counts on it.
    counts = multihost_utils.process_allgather(np.asarray([num_processes]))
    if np.any(counts != jax.process_count()):
        raise JspecError(f"the processes disagree on --num-processes ({', '.join(map(str, counts.ravel()))} "
                         f"by process id); the coordinator expects {jax.process_count()}")


def _give_up(message: str, status: int = 2) -> None:
    """A clean exit from a thread while the main thread is stuck inside jax's C++ (no exception
    can reach it there): the CLI's one-line error and exit `status` (2: the CLI's for bad input)."""
    _last_word.acquire()  # one line a process: a second thread that gets here waits for the exit
    _say(message)
    os._exit(status)


def _say(message: str, fresh_line: bool = False) -> None:
    print(("\n" if fresh_line else "") + f"jspec: error: {message}", file=sys.stderr, flush=True)


def _run():
    """jax's state of the multi-process run this process joined (its process_id, num_processes and
    the coordination service's client), or None outside one. jax has no public path to the
    service's key-value store (0.10); its own multihost_utils reads it here too."""
    from jax._src import distributed as jax_distributed

    run = jax_distributed.global_state
    return run if jax.distributed.is_initialized() and run.num_processes > 1 else None


def _start_watchdog() -> None:
    run = _run()
    if run is None:
        return
    watchdog = threading.Thread(target=_watch, args=(run.client, run.process_id, run.num_processes),
                                name="jspec-watchdog", daemon=True)
    watchdog.start()
    atexit.register(_leave, watchdog)  # registered after jax's exit hook, so it runs first


def _leave(watchdog: threading.Thread) -> None:
    """At exit: through jax's shutdown barrier with the watchdog still watching (a process that
    fails while this one waits there ends it too), then the watchdog stopped: a thread inside
    jax's C++ when Python finalizes aborts the process."""
    _exiting.set()
    jax.distributed.shutdown()
    watchdog.join(timeout=2 * _POLL_MS / 1000)


def _watch(client, me: int, count: int) -> None:
    """Until this process exits (through jax's shutdown barrier too): end it, in one line, once
    another process has failed (with that process's status), or once the coordination service is
    gone where jax has not aborted it for that first."""
    while True:
        try:
            failure = client.blocking_key_value_get(_FAILED, _POLL_MS)
        except Exception as e:  # jax's errors begin with their gRPC status
            if str(e).startswith("DEADLINE_EXCEEDED"):  # nothing failed within the poll
                continue
            if _exiting.is_set():  # the run is over: the service shuts down with it
                return
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            _give_up(f"lost the run's coordination service (did process 0 stop?): {reason}", 1)
        process, status, message = failure.split(" ", 2)
        if int(process) == me:  # fail() is ending this process
            return
        _last_word.acquire()
        # Process 0 may be drawing a progress bar (the CLI's), which ends without a newline.
        _say(f"process {process} failed: {message}", fresh_line=me == 0)
        if me == 0:
            _let_the_others_read(client, count, int(process))
        else:
            try:
                client.key_value_set(_SEEN + str(me), "")
            except Exception:  # process 0 has gone already
                pass
        os._exit(int(status))


def _let_the_others_read(client, count: int, failed: int) -> None:
    """On process 0, which holds the coordination service: wait (a few seconds at most) until
    every process but the failed one has read the failure. When the service goes, jax aborts the
    processes still connected to it (a C++ fatal error), before their watchdogs can say a word."""
    deadline, read = time.monotonic() + _ACK_S, False
    for process in range(1, count):
        left = int((deadline - time.monotonic()) * 1000)
        if process != failed and left > 0:
            try:
                client.blocking_key_value_get(_SEEN + str(process), left)
                read = True
            except Exception:  # stuck where its watchdog cannot run: the deadline bounds the wait
                pass
    # A process that has said it read the failure is on its way out, and so is the failed one when
    # it is not this one (several may fail at once: a check every process makes): let them get there.
    if read or failed != 0:
        time.sleep(_LINGER_S)


def fail(message: str, status: int) -> None:
    """In a multi-process run, end this process for an error in it: print `jspec: error: MESSAGE`,
    tell the other processes (each of their watchdogs prints `process N failed: MESSAGE` and exits
    with `status`) and exit with `status` within seconds, without waiting in jax's shutdown
    barrier for processes it was computing with. Returns, doing nothing, in a run of one process."""
    run = _run()
    if run is None:
        return
    _last_word.acquire()
    try:
        sys.stdout.flush()
    except (OSError, ValueError):
        pass
    _say(message)
    failed = run.process_id
    try:
        run.client.key_value_set(_FAILED, f"{failed} {status} {' '.join(message.split())}")
    except Exception:  # another process failed first (the others are reading its failure), or the service is gone
        try:
            failed = int(run.client.key_value_try_get(_FAILED).split(" ", 1)[0])
        except Exception:
            os._exit(status)
    if run.process_id == 0:
        _let_the_others_read(run.client, run.num_processes, failed)
    os._exit(status)


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


def joined() -> bool:
    """Whether this process is one of a multi-process run (of more than one process)."""
    return _run() is not None


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
