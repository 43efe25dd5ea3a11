"""math-verify's equivalence with a time bound that holds in any thread, and across threads.

math-verify bounds its own time with `signal.alarm`, which only the main thread may set: under an async reward or a
thread pool it raised, and the reward fell back to string matching (`Answer: 0.5` against `1/2` scored -1 there and +1
on the main thread). Here math-verify runs with its own timeouts off, in a worker process. One worker per process;
calls from several threads take turns on it, so a verdict never depends on the calling thread.

A question gets at most `timeout` seconds of the worker's time. A call given a deadline (the math reward's, for the
bound it promises per call) returns None past it, whatever it waited for: its turn on the worker (other threads'
questions), a worker still starting after a timeout, the verdict. A question out of time ends the worker, and its
replacement starts at once, importing math-verify while the next callers wait their turn. Only the worker's first
start in a process (`start`: importing sympy, seconds) is counted against no deadline.

The worker is a plain Python process running this file, not a `multiprocessing` child: those re-import the caller's
main script, which a training script without an `if __name__ == "__main__":` guard would run again. It imports
neither this package (torch, TRL) nor anything beside this file (a `math.py` sits here), only math-verify. It starts
isolated (`python -I`: no current folder, no script folder, no `PYTHONPATH`, no user site), then adds the folders that
math-verify and the packages it requires are installed in (`site.addsitedir`, so their `.pth` files and editable
installs work), and nothing else: the caller's own path held its working folder as an absolute entry under
`python -m` and a script's folder under `python script.py`, so a `sympy.py` there would have run in the worker.

A process forked while another thread waits on the worker (a `DataLoader` worker, `multiprocessing` with fork) copied
the lock held and the parent's pipes: the child's first call blocked forever. After a fork the child forgets both
(`os.register_at_fork`) and starts its own worker; the pipes are unbuffered, so closing the child's copies sends the
parent's worker nothing.
"""

from __future__ import annotations

import json
import logging
import math
import os
import select
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path

START_TIMEOUT = 120.0  # seconds for a worker to import math-verify (sympy) before it counts as broken
READY = "ready"
WORKER_DISTRIBUTION = "math-verify"


def _as_latex(answer: str) -> str:
    return answer if "$" in answer or "\\boxed" in answer else f"${answer}$"


def _serve() -> None:
    """The worker: one JSON request (`[answer, ground_truth]`) per line in, one verdict (`true` / `false`) out."""
    from math_verify import parse, verify

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # its note that its own timeouts are off, per call
    print(READY, flush=True)
    for line in sys.stdin:
        answer, truth = json.loads(line)
        try:
            gold = parse(_as_latex(truth), parsing_timeout=None)
            guess = parse(_as_latex(answer), parsing_timeout=None)
            same = bool(gold and guess and verify(gold, guess, timeout_seconds=None))
        except Exception:  # math-verify raises on pathological inputs: no verdict of equivalence
            same = False
        print(json.dumps(same), flush=True)


def installed_folders(distribution: str = WORKER_DISTRIBUTION) -> list[str]:
    """The folders (site-packages, a user site, a `--target` folder) that `distribution` and every package it requires
    are installed in, as the caller's interpreter finds them; empty when it is not installed."""
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    folders: list[str] = []
    seen, waiting = set(), [distribution]
    while waiting:
        name = canonicalize_name(waiting.pop())
        if name in seen:
            continue
        seen.add(name)
        try:
            found = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # the worker's start then fails, naming math-verify
        folder = str(Path(found.locate_file("")).resolve())
        folders += [folder] if folder not in folders else []
        for text in found.requires or []:
            requirement = Requirement(text)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                waiting.append(requirement.name)
    return folders


def worker_command() -> list[str]:
    """This file run by an isolated interpreter whose path is its own (the standard library, its site-packages) and
    the folders math-verify and its requirements are installed in."""
    file = str(Path(__file__).resolve())
    script = (
        "import runpy, site, sys\n"
        f"for folder in {installed_folders()!r}:\n"
        "    if folder not in sys.path:\n"
        "        site.addsitedir(folder)\n"
        f"runpy.run_path({file!r}, run_name='__main__')\n"
    )
    return [sys.executable, "-I", "-c", script]


class _Process:
    """A worker process and whether it has said it is ready (importing math-verify takes seconds)."""

    def __init__(self) -> None:
        self.popen = subprocess.Popen(worker_command(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
        self.started = time.monotonic()
        self.ready = False

    def read(self, seconds: float) -> str | None:
        """Its next line (empty once it has exited), or None when none came within `seconds`."""
        readable, _, _ = select.select([self.popen.stdout], [], [], max(seconds, 0.0))
        return self.popen.stdout.readline().decode().strip() if readable else None

    def wait_ready(self, until: float) -> bool:
        """Whether it is ready by `until` (`time.monotonic()`); a worker that exited, or is still not ready
        `START_TIMEOUT` seconds after it started, is a `RuntimeError`."""
        if self.ready:
            return True
        limit = self.started + START_TIMEOUT
        line = self.read(min(until, limit) - time.monotonic())
        if line == READY:
            self.ready = True
        elif line is not None or time.monotonic() >= limit:  # it exited (or said something else), or hangs
            self.end()
            raise RuntimeError(
                f"the math-verify worker ({sys.executable} -I {__file__}) did not start: math-verify must import in "
                "this interpreter (`pip install math-verify`)."
            )
        return self.ready

    def send(self, request: str) -> None:
        """One request line, whole (an unbuffered pipe may take part of it per write)."""
        data = (request + "\n").encode()
        while data:
            data = data[self.popen.stdin.write(data) :]

    def end(self) -> None:
        self.popen.kill()
        self.popen.wait()
        self.close_pipes()

    def close_pipes(self) -> None:
        self.popen.stdin.close()
        self.popen.stdout.close()


class EquivalenceWorker:
    """A math-verify worker process, started on first use, replaced after a timeout (or in a forked child); safe to
    call from any thread, each call bounded by its own deadline."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._first_start = threading.Lock()  # held by the thread starting the first worker; others wait on it
        self._started_once = threading.Event()
        self._process: _Process | None = None
        _WORKERS.add(self)

    def start(self) -> None:
        """Start the first worker and wait until it is ready (seconds: importing math-verify), counted against no
        call; at once when one has been ready in this process (a replacement's start counts against calls)."""
        if self._started_once.is_set():
            return
        with self._first_start:
            if self._started_once.is_set():
                return
            with self._lock:
                self._ready_by(time.monotonic() + START_TIMEOUT)
            self._started_once.set()

    def _ready_by(self, until: float) -> bool:
        """Whether a worker is ready by `until`, one started if none runs (the lock held)."""
        if self._process is None or self._process.popen.poll() is not None:
            self._process = _Process()
        return self._process.wait_ready(until)

    def equivalent(self, answer: str, ground_truth: str, timeout: float, deadline: float | None = None) -> bool | None:
        """Whether math-verify finds `answer` equal to `ground_truth`; None when it took more than `timeout` seconds of
        the worker's time, or when the call would run past `deadline` (`time.monotonic()`), its waits for the worker
        (another thread's question, a replacement still starting) included. Without a deadline those waits are not
        bounded, and the question gets its whole `timeout`."""
        self.start()
        bounded = deadline is not None
        if not self._lock.acquire(timeout=max(deadline - time.monotonic(), 0.0) if bounded else -1):
            return None
        try:
            if not self._ready_by(deadline if bounded else math.inf):
                return None
            seconds = min(timeout, deadline - time.monotonic()) if bounded else timeout
            if seconds <= 0:
                return None
            self._process.send(json.dumps([answer, ground_truth]))
            verdict = self._process.read(seconds)
            if not verdict:  # out of time (or it died): end it, and start its replacement now
                self._process.end()
                self._process = _Process()
                return None
            return json.loads(verdict)
        finally:
            self._lock.release()

    def close(self) -> None:
        """End the worker; the next call starts another as a first one (`start`)."""
        with self._lock:
            if self._process is not None:
                self._process.end()
                self._process = None
            self._started_once.clear()

    def forget_after_fork(self) -> None:
        """In a forked child: new locks (the parent's may have been copied held) and no worker (the parent's pipes,
        closed here in the child only); the child's first worker starts as a first one."""
        self._lock, self._first_start = threading.Lock(), threading.Lock()
        self._started_once = threading.Event()
        if self._process is not None:
            self._process.close_pipes()
            self._process = None


_WORKERS: weakref.WeakSet[EquivalenceWorker] = weakref.WeakSet()


def _forget_workers_after_fork() -> None:
    for worker in _WORKERS:
        worker.forget_after_fork()


os.register_at_fork(after_in_child=_forget_workers_after_fork)


if __name__ == "__main__":
    _serve()
