"""Measurements each in a process of its own, under a time limit. A child that hangs, runs out of memory or crashes
(vLLM's engine core, an allocator left fragmented, a trainer that holds the device) takes nothing else down, and the
device is empty again when it exits. The child writes its result as JSON and, as it goes, its progress; the parent
turns each child into an outcome record: measured, timed out (with how far the child got), out of memory, or an
error with its last lines. A run cut short keeps the records before it, and a rerun skips what it already holds."""

from __future__ import annotations

import collections
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).parents[2]  # the repository root, where `python -m benchmarks...` finds the package
OK, TIMEOUT, OUT_OF_MEMORY, ERROR = "ok", "timeout", "out of memory", "error"
# What torch prints when an allocation fails (in the child's last lines); vLLM's own "not enough memory for the KV
# cache" at start-up is a set-up error, which a smaller micro-batch would not fix.
OUT_OF_MEMORY_MARKERS = ("torch.OutOfMemoryError", "CUDA out of memory")
TAIL_LINES = 60


@dataclass
class Outcome:
    """How a child ended: `status` one of OK, TIMEOUT, OUT_OF_MEMORY, ERROR; its wall time; the result it wrote (OK
    only); its last progress report; for an error its last lines."""

    status: str
    seconds: float
    result: dict | None = None
    progress: dict = field(default_factory=dict)
    error: str | None = None
    finished_at: float = 0.0  # time.time() when it ended (for the progress timestamps, also time.time())

    def record(self, timeout: float) -> dict:
        """What the parent's JSON keeps of a child that did not finish (a finished child's result is the record)."""
        record = {"status": self.status, "seconds": self.seconds, "progress": self.progress}
        if self.status == TIMEOUT:
            record["timeout_s"] = timeout
        if self.error:
            record["error"] = self.error
        return record


def progress_path(result_path: Path) -> Path:
    return Path(result_path).with_suffix(".progress.json")


def report_progress(result_path: Path | str, **fields) -> None:
    """Called by a child: merge `fields` into its progress file (with the time, time.time()), written whole."""
    path = progress_path(Path(result_path))
    progress = json.loads(path.read_text()) if path.exists() else {}
    progress.update(fields, time=time.time())
    scratch = path.with_suffix(".tmp")
    scratch.write_text(json.dumps(progress))
    scratch.replace(path)


def write_result(result_path: Path | str, result: dict) -> None:
    """Called by a child at its end: its result, which the parent reads once the child exits with status 0."""
    Path(result_path).write_text(json.dumps(result, default=str))


def _echo(stream, tail: collections.deque) -> None:
    """Print the child's output as it comes (the run's log) and keep its last lines."""
    for line in stream:
        sys.stdout.write(line)
        sys.stdout.flush()
        tail.append(line.rstrip("\n"))


def _stop(process: subprocess.Popen, grace: float = 15.0) -> None:
    """End the child and every process it started (its own session: vLLM's engine core can outlive its parent),
    asking first; whatever is left of the session is killed, so the device is free for the next child."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=grace)
    deadline = time.monotonic() + 10.0  # a killed grandchild may take a moment to die, holding the device meanwhile
    while _live_members(process.pid) and time.monotonic() < deadline:
        time.sleep(0.05)


def _live_members(group: int) -> bool:
    """Whether a process of process group `group` is still running (zombies do not count: they hold nothing)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if fields[0] != "Z" and int(fields[2]) == group:
                return True
    return False


@contextlib.contextmanager
def _terminated_as_exit():
    """While a child runs, a SIGTERM to this process (`timeout`, a job's end) raises SystemExit instead of ending it
    at once, so the child's session is stopped on the way out: the child started a session of its own, and would
    otherwise go on holding the device after its parent is gone."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def exit_now(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, exit_now)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_isolated(command: list[str], result_path: Path, timeout: float, env: dict | None = None) -> Outcome:
    """Run `command` (from the repository root) until it exits or `timeout` seconds pass; read what it wrote to
    `result_path` and its progress file."""
    result_path = Path(result_path)
    for path in (result_path, progress_path(result_path)):
        path.unlink(missing_ok=True)
    start = time.perf_counter()
    process = subprocess.Popen(
        command, cwd=ROOT, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True,
    )  # fmt: skip
    tail: collections.deque = collections.deque(maxlen=TAIL_LINES)
    reader = threading.Thread(target=_echo, args=(process.stdout, tail), daemon=True)
    reader.start()
    code = None
    with _terminated_as_exit():
        try:
            code = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        finally:
            _stop(process, grace=15.0 if code is None else 0.0)
    reader.join(timeout=15)
    seconds, finished_at = time.perf_counter() - start, time.time()
    progress = json.loads(progress_path(result_path).read_text()) if progress_path(result_path).exists() else {}
    if code is None:
        return Outcome(TIMEOUT, seconds, progress=progress, finished_at=finished_at)
    if code == 0 and result_path.exists():
        return Outcome(OK, seconds, json.loads(result_path.read_text()), progress, finished_at=finished_at)
    text = "\n".join(tail)
    status = OUT_OF_MEMORY if any(marker in text for marker in OUT_OF_MEMORY_MARKERS) else ERROR
    last = [line for line in tail if line.strip()][-3:] or [f"exit status {code}"]
    return Outcome(status, seconds, progress=progress, error=" | ".join(last)[-600:], finished_at=finished_at)


def already_done(record: dict | None, timeout: float) -> bool:
    """Whether a rerun would only repeat `record`: measured, out of memory, or timed out under a limit at least
    `timeout` (a longer limit measures again; an error always runs again, the code may have changed)."""
    if not record:
        return False
    status = record.get("status", OK)
    return status in (OK, OUT_OF_MEMORY) or (status == TIMEOUT and record.get("timeout_s", 0) >= timeout)
