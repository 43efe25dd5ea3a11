"""Timing and profiling: device-synchronised clocks, per-step trainer timers and profiles, and the hardware ceilings
(bf16 matrix rate, copy bandwidth) that MFU and bandwidth use are read against."""

from __future__ import annotations

import collections
import contextlib
import cProfile
import io
import pstats
import shutil
import statistics
import subprocess
import threading
import time
import warnings
from pathlib import Path

import torch
from transformers import TrainerCallback


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class StepTimer(TrainerCallback):
    """Wall time of each optimizer step, device-synchronised at both ends."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def on_step_begin(self, args, state, control, **kwargs):
        synchronize()
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        synchronize()
        self.times.append(time.perf_counter() - self._start)


class StepProfiler(TrainerCallback):
    """Profile one optimizer step, written to `path` as a text report: the Python functions that take the most time
    (cumulative, host clock: where a step's extra milliseconds go), the ops that take the most time and, on CUDA, how
    many calls made the host wait for the device (each one stalls kernel launches)."""

    def __init__(self, step: int, path: Path) -> None:
        self.step, self.path = step, path

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step != self.step:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.set_sync_debug_mode("warn")
        self._warnings = warnings.catch_warnings(record=True)
        self._caught = self._warnings.__enter__()
        warnings.simplefilter("always")
        self._profile = torch.profiler.profile(activities=activities)
        self._profile.__enter__()
        self._python = cProfile.Profile()
        self._python.enable()

    def on_step_end(self, args, state, control, **kwargs):
        if not hasattr(self, "_profile") or state.global_step != self.step + 1:
            return
        synchronize()
        self._python.disable()
        self._profile.__exit__(None, None, None)
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("default")
        self._warnings.__exit__(None, None, None)
        syncs = [w for w in self._caught if "synchroniz" in str(w.message)]
        sites = collections.Counter(f"{Path(w.filename).name}:{w.lineno}" for w in syncs)
        functions = io.StringIO()
        pstats.Stats(self._python, stream=functions).strip_dirs().sort_stats("cumulative").print_stats(80)
        averages = self._profile.key_averages()
        device_sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        self.path.write_text(
            f"host synchronisations in the step: {len(syncs)}\n"
            + "".join(f"  {count:4d}  {site}\n" for site, count in sites.most_common(30))
            + "\n" + functions.getvalue()
            + "\n" + averages.table(sort_by="self_cpu_time_total", row_limit=30)
            + "\n" + averages.table(sort_by=device_sort, row_limit=30)
        )  # fmt: skip
        del self._profile, self._python


def time_methods(
    trainer,
    sections: dict[str, list[tuple[int, float]]],
    generated: list[tuple[int, int]],
    trained: list[tuple[int, int, int]] | None = None,
    engine_calls: list[dict] | None = None,
) -> None:
    """Time the trainer's own methods by wrapping them (device-synchronised): generation, the no-grad logprob pass,
    generation + scoring + bookkeeping, and whole micro-batch training steps (which contain the former). Each call is
    recorded with the optimizer step it ran in; each generation call's completion tokens go to `generated`, and each
    training forward's `(step, real tokens, padded tokens)` (rows x width of the batch it was handed) to `trained`
    when given. With `engine_calls`, each call of the trainer's paged engine is recorded there too
    (`record_engine_calls`); a stream generates outside the generation hook, so its time counts as generation."""

    def timed(name, function):
        def wrapper(*args, **kwargs):
            synchronize()
            start = time.perf_counter()
            result = function(*args, **kwargs)
            synchronize()
            key = name if name != "logps" else ("train_forward" if torch.is_grad_enabled() else "logprob_pass")
            step = trainer.state.global_step
            sections.setdefault(key, []).append((step, time.perf_counter() - start))
            if name == "generation":  # returns (completion ids, logprobs)
                generated.append((step, sum(map(len, result[0]))))
            if key == "train_forward" and trained is not None:  # (model, input_ids, attention_mask, ...)
                input_ids, attention_mask = args[1], args[2]
                trained.append((step, int(attention_mask.sum()), input_ids.numel()))
            return result

        return wrapper

    # DAPO collects a generation batch in a method of its own (each round calls TRL's), and runs every logprob
    # forward, its training passes' and TRL's, through its `passes` object
    dapo = hasattr(trainer, "passes")
    for owner, name, method in [
        (trainer, "generation", "_generate_single_turn"),
        (trainer.passes if dapo else trainer, "logps", "logprobs" if dapo else "_get_per_token_logps_and_entropies"),
        (trainer, "generate_and_score", "_collect_generation_batch" if dapo else "_generate_and_score_completions"),
        (trainer, "training_step", "training_step"),
    ]:
        setattr(owner, method, timed(name, getattr(owner, method)))
    engine = getattr(trainer, "paged_engine", None)
    if engine_calls is not None and engine is not None:
        record_engine_calls(
            engine, lambda: trainer.state.global_step, engine_calls, sections.setdefault("generation", [])
        )


def record_engine_calls(engine, step, calls: list[dict], stream_times: list[tuple[int, float]]) -> None:
    """Record every call of a paged rollout engine in `calls`: the optimizer step it ran in (`step()`), its
    device-synchronised wall time and its `RolloutStats`: a `generate`, or a stream from its opening to its `close`
    (a stream's `(step, seconds)` also goes to `stream_times`). Wraps the engine's own methods."""
    generate, stream = engine.generate, engine.stream

    def timed_generate(*args, **kwargs):
        synchronize()
        start = time.perf_counter()
        output = generate(*args, **kwargs)
        synchronize()
        calls.append({"step": step(), "seconds": time.perf_counter() - start, **output.stats.as_dict()})
        return output

    def timed_stream(*args, **kwargs):
        synchronize()
        start, opened_in = time.perf_counter(), step()
        opened = stream(*args, **kwargs)
        close = opened.close

        def timed_close():
            # this closure refers to the stream: left on it, the cycle would keep it until a full collection
            del opened.close
            stats = close()
            synchronize()
            seconds = time.perf_counter() - start
            calls.append({"step": opened_in, "seconds": seconds, **stats.as_dict()})
            stream_times.append((opened_in, seconds))
            return stats

        opened.close = timed_close
        return opened

    engine.generate, engine.stream = timed_generate, timed_stream


def timed_call(function, *args, **kwargs) -> tuple[object, float]:
    """`function(*args, **kwargs)` and its device-synchronised wall time in seconds."""
    synchronize()
    start = time.perf_counter()
    result = function(*args, **kwargs)
    synchronize()
    return result, time.perf_counter() - start


def median_seconds(function, repeats: int = 20) -> float:
    """Median time of `function` after 3 warm-up calls (CUDA events on the GPU, the host clock on the CPU)."""
    for _ in range(3):
        function()
    times = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            function()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            times.append(timed_call(function)[1])
    return statistics.median(times)


def copy_bandwidth(device: str) -> float:
    """Measured device copy bandwidth in bytes/s, counting bytes read + written (1 GiB on CUDA, 16 MiB on the CPU)."""
    values = 2**29 if device == "cuda" else 2**23
    src = torch.randn(values, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    seconds = median_seconds(lambda: dst.copy_(src), repeats=20)
    return 2 * src.numel() * src.element_size() / seconds


def hardware_ceilings(device: str) -> dict:
    """Measured bf16 matrix rate and device copy bandwidth (the limits MFU and decode bandwidth are read against)."""
    if device != "cuda":
        return {}
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    matmul_s = median_seconds(lambda: a @ b, repeats=20)
    return {"bf16_tflops": 2 * 8192**3 / matmul_s / 1e12, "copy_tb_per_s": copy_bandwidth(device) / 1e12}


def device_memory_gib() -> tuple[float, float] | None:
    """(used, total) GiB of device 0 across every process on it, from `nvidia-smi` (vLLM's engine core runs in a
    process of its own; asking torch would make a CUDA context in this one), else from torch where this process has
    one; None on the CPU."""
    if shutil.which("nvidia-smi"):
        query = ["nvidia-smi", "--query-gpu=memory.used,memory.total", "--format=csv,noheader,nounits", "--id=0"]
        done = subprocess.run(query, capture_output=True, text=True, timeout=10)
        if done.returncode == 0:
            used, total = (float(value) / 1024 for value in done.stdout.split(","))
            return used, total
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        free, total = torch.cuda.mem_get_info()
        return (total - free) / 2**30, total / 2**30
    return None


class DeviceMemoryPeak:
    """The peak of the device's used memory (`device_memory_gib`: every process on it, each engine's own pool and
    preallocations included, comparable across engines that count their memory each their own way) while open, read
    every `interval_ms` by one `nvidia-smi` process (a spike shorter than that can be missed; without nvidia-smi only
    the marks sample it). `mark()` returns the peak since the last mark."""

    def __init__(self, interval_ms: int = 100) -> None:
        self.interval_ms, self.peak, self.since_mark, self.total = interval_ms, None, None, None
        self._process: subprocess.Popen | None = None
        self._thread: threading.Thread | None = None

    def _update(self, used: float) -> None:
        self.peak = max(self.peak or 0.0, used)
        self.since_mark = max(self.since_mark or 0.0, used)

    def _read(self) -> None:
        for line in self._process.stdout:
            with contextlib.suppress(ValueError):
                self._update(float(line.split(",")[0]) / 1024)

    def mark(self) -> float | None:
        reading = device_memory_gib()
        if reading is not None:
            self._update(reading[0])
        peak, self.since_mark = self.since_mark, None
        return peak

    def __enter__(self) -> DeviceMemoryPeak:
        reading = device_memory_gib()
        if reading is None:
            return self
        self._update(reading[0])
        self.total = reading[1]
        if shutil.which("nvidia-smi"):
            query = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "--id=0"]
            self._process = subprocess.Popen(
                [*query, f"--loop-ms={self.interval_ms}"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
            )
            self._thread = threading.Thread(target=self._read, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._process is not None:
            self._process.terminate()
            self._process.wait(timeout=10)
            self._thread.join(timeout=10)
