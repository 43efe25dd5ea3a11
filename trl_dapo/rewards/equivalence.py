"""math-verify's equivalence with a time bound that holds in any thread.

math-verify bounds its own time with `signal.alarm`, which only the main thread may set: under an async reward or a
thread pool it raised, and the reward fell back to string matching (`Answer: 0.5` against `1/2` scored -1 there and +1
on the main thread). Here math-verify runs with its own timeouts off, in a worker process: the caller waits at most
`timeout` seconds for a verdict and, past it, ends the worker (the next call starts another) and gets None. One worker
per process; calls from several threads take turns on it, so a verdict never depends on the calling thread.

The worker is a plain Python process running this file, not a `multiprocessing` child: those re-import the caller's
main script, which a training script without an `if __name__ == "__main__":` guard would run again. It imports
neither this package (torch, TRL) nor anything beside this file (a `math.py` sits here), only math-verify. It starts
isolated (`python -I`): `python -c` put the current folder first on its path, so a `json.py` there ran in the worker
though the caller never imported it. Its path is then the caller's own less relative entries (the current folder), so
math-verify is found wherever the caller finds it (a virtual environment, an editable install, the user's site
folder, `PYTHONPATH`).

A process forked while another thread waits on the worker (a `DataLoader` worker, `multiprocessing` with fork) copied
the lock held and the parent's pipes: the child's first call blocked forever. After a fork the child forgets both
(`os.register_at_fork`) and starts its own worker; the pipes are unbuffered, so closing the child's copies sends the
parent's worker nothing.
"""

from __future__ import annotations

import json
import logging
import os
import select
import subprocess
import sys
import threading
import weakref
from pathlib import Path

START_TIMEOUT = 120.0  # seconds for the worker to import math-verify (sympy): not counted against any answer
READY = "ready"


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


def _worker_command() -> list[str]:
    """This file run by an isolated interpreter whose path is the caller's absolute entries (`''` and other relative
    ones name the current folder)."""
    path = [entry for entry in sys.path if os.path.isabs(entry)]
    file = str(Path(__file__).resolve())
    return [
        sys.executable,
        "-I",
        "-c",
        f"import sys, runpy; sys.path[:] = {path!r}; runpy.run_path({file!r}, run_name='__main__')",
    ]


class EquivalenceWorker:
    """A math-verify worker process, started on first use and again after a timeout (or in a forked child); safe to
    call from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._process: subprocess.Popen | None = None
        _WORKERS.add(self)

    def _start(self) -> subprocess.Popen:
        process = subprocess.Popen(_worker_command(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
        if self._read(process, START_TIMEOUT) != READY:
            self._end(process)
            raise RuntimeError(
                f"the math-verify worker ({sys.executable} -I {__file__}) did not start: math-verify must import in "
                "this interpreter (`pip install math-verify`)."
            )
        return process

    @staticmethod
    def _read(process: subprocess.Popen, timeout: float) -> str | None:
        """The worker's next line, or None when none came within `timeout` seconds (or it exited)."""
        ready, _, _ = select.select([process.stdout], [], [], max(timeout, 0.0))
        line = process.stdout.readline() if ready else b""
        return line.decode().strip() or None

    @staticmethod
    def _end(process: subprocess.Popen) -> None:
        process.kill()
        process.wait()
        process.stdin.close()
        process.stdout.close()

    def start(self) -> None:
        """Start the worker now (importing math-verify takes seconds), so no answer's or batch's time is spent on it."""
        with self._lock:
            self._ensure_started()

    def _ensure_started(self) -> None:
        if self._process is None or self._process.poll() is not None:
            self._process = self._start()

    def _send(self, request: str) -> None:
        """One request line to the worker, whole (an unbuffered pipe may take part of it per write)."""
        data = (request + "\n").encode()
        while data:
            data = data[self._process.stdin.write(data) :]

    def equivalent(self, answer: str, ground_truth: str, timeout: float) -> bool | None:
        """Whether math-verify finds `answer` equal to `ground_truth`; None when it took more than `timeout`
        seconds (counted from when the worker has the question, not while another thread's question runs)."""
        with self._lock:
            self._ensure_started()
            self._send(json.dumps([answer, ground_truth]))
            verdict = self._read(self._process, timeout)
            if verdict is None:
                self._end(self._process)
                self._process = None
                return None
            return json.loads(verdict)

    def close(self) -> None:
        with self._lock:
            if self._process is not None:
                self._end(self._process)
                self._process = None

    def forget_after_fork(self) -> None:
        """In a forked child: a new lock (the parent's may have been copied held) and no worker (the parent's pipes,
        closed here in the child only)."""
        self._lock = threading.Lock()
        if self._process is not None:
            self._process.stdin.close()
            self._process.stdout.close()
            self._process = None


_WORKERS: weakref.WeakSet[EquivalenceWorker] = weakref.WeakSet()


def _forget_workers_after_fork() -> None:
    for worker in _WORKERS:
        worker.forget_after_fork()


os.register_at_fork(after_in_child=_forget_workers_after_fork)


if __name__ == "__main__":
    _serve()
