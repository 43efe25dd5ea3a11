"""math-verify's equivalence with a time bound that holds in any thread.

math-verify bounds its own time with `signal.alarm`, which only the main thread may set: under an async reward or a
thread pool it raised, and the reward fell back to string matching (`Answer: 0.5` against `1/2` scored -1 there and +1
on the main thread). Here math-verify runs with its own timeouts off, in a worker process: the caller waits at most
`timeout` seconds for a verdict and, past it, ends the worker (the next call starts another) and gets None. One worker
per process; calls from several threads take turns on it, so a verdict never depends on the calling thread.

The worker is a plain Python process running this file, not a `multiprocessing` child: those re-import the caller's
main script, which a training script without an `if __name__ == "__main__":` guard would run again. It imports
neither this package (torch, TRL) nor anything beside this file (a `math.py` sits here), only math-verify.
"""

from __future__ import annotations

import json
import logging
import os
import select
import subprocess
import sys
import threading
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


class EquivalenceWorker:
    """A math-verify worker process, started on first use and again after a timeout; safe to call from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._process: subprocess.Popen | None = None
        self._owner = os.getpid()  # a forked child must not share the parent's pipes: it starts its own worker

    def _start(self) -> subprocess.Popen:
        run = f"import runpy; runpy.run_path({str(Path(__file__).resolve())!r}, run_name='__main__')"
        process = subprocess.Popen(
            [sys.executable, "-c", run], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        if self._read(process, START_TIMEOUT) != READY:
            self._end(process)
            raise RuntimeError(f"the math-verify worker ({sys.executable} {__file__}) did not start.")
        return process

    @staticmethod
    def _read(process: subprocess.Popen, timeout: float) -> str | None:
        """The worker's next line, or None when none came within `timeout` seconds (or it exited)."""
        ready, _, _ = select.select([process.stdout], [], [], max(timeout, 0.0))
        line = process.stdout.readline() if ready else ""
        return line.strip() or None

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
        if self._owner != os.getpid():
            self._process, self._owner = None, os.getpid()
        if self._process is None or self._process.poll() is not None:
            self._process = self._start()

    def equivalent(self, answer: str, ground_truth: str, timeout: float) -> bool | None:
        """Whether math-verify finds `answer` equal to `ground_truth`; None when it took more than `timeout`
        seconds (counted from when the worker has the question, not while another thread's question runs)."""
        with self._lock:
            self._ensure_started()
            self._process.stdin.write(json.dumps([answer, ground_truth]) + "\n")
            self._process.stdin.flush()
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


if __name__ == "__main__":
    _serve()
