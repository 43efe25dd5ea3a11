"""`DAPOConfig`: TRL's `GRPOConfig` with the DAPO recipe's defaults and the fields DAPO adds."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

from transformers import TrainingArguments
from transformers.utils import is_torch_bf16_gpu_available, is_torch_xla_available
from trl import GRPOConfig

from .field_rules import check_field_rules, invalid_value
from .grpo_fields import unhonoured_settings
from .mismatch import CORRECTION_MODES

ON_LIMIT_CHOICES = ("raise", "train_on_partial")
ROLLOUT_ENGINES = ("auto", "paged", "trl")
OLD_LOGPROBS_CHOICES = ("rollout", "recompute")
ROLLOUT_PRECISIONS = ("bf16", "fp8")
SAMPLING_MODES = ("rounds", "stream")
IN_FLIGHT_CHOICES = ("finish", "drop", "carry")
DEFAULT_CORRECTION_MAX = 2.0
DEFAULT_MAX_IN_FLIGHT = 3.0


def _joined(counts: list[int]) -> str:
    """1, 2 or 4."""
    names = [str(count) for count in counts]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


@dataclass
class _GenerationBatchCheck(TrainingArguments):
    """Runs between `TrainingArguments.__post_init__` (which sets up the processes, so the world size is known) and
    the rest of `GRPOConfig.__post_init__` (which derives `generation_batch_size` and, when it holds no whole number
    of groups, raises an error naming neither field to change). In `DAPOConfig`'s method resolution order this class
    sits between `GRPOConfig` and `TrainingArguments`, so GRPOConfig's `super().__post_init__()` lands here."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check_whole_groups()


@dataclass
class DAPOConfig(GRPOConfig, _GenerationBatchCheck):
    r"""
    Configuration for [`DAPOTrainer`]. Every [`~trl.GRPOConfig`] field is accepted; the ones below are added or take
    the DAPO paper's (arXiv 2503.14476) values instead of TRL's.

    Parameters:
        > DAPO defaults of fields inherited from `GRPOConfig`

        bf16 (`bool` or `None`, *optional*, defaults to `None`):
            `None` turns bf16 on where it can run (a bf16 GPU, XLA, or `use_cpu=True`, as TRL would) and off
            elsewhere, where TRL's default would refuse to start. On a CPU without bf16 instructions torch emulates
            bf16, several times slower than float32: the trainer warns once, naming `bf16=False`.

        epsilon (`float`, *optional*, defaults to `0.2`):
            Lower clip range ε_low: ratios below `1 - epsilon` stop pushing a negative-advantage token down.
        epsilon_high (`float`, *optional*, defaults to `0.28`):
            Upper clip range ε_high (Clip-Higher): ratios above `1 + epsilon_high` stop pushing a positive-advantage
            token up. Larger than `epsilon` so rare tokens can still gain probability (against entropy collapse).
        beta (`float`, *optional*, defaults to `0.0`):
            KL coefficient. DAPO removes the KL term; any other value is rejected.
        loss_type (`str`, *optional*, defaults to `"dapo"`):
            Token-level loss: the sum of per-token losses over every response token of the optimizer step (all
            micro-batches, all ranks) divided by that global token count. Only `"dapo"` is accepted.
        num_generations (`int`, *optional*, defaults to `16`):
            Samples per prompt (the group size G).
        per_device_train_batch_size (`int`, *optional*, defaults to `16`):
            Completions per device and micro-batch: one group of the default 16, so the generation batch holds whole
            groups on any number of processes. Scale the batch with `gradient_accumulation_steps` (more rows per
            optimizer step) or `steps_per_generation` (more optimizer steps per generation batch).
        per_device_eval_batch_size (`int`, *optional*, defaults to `16`):
            Completions per device and evaluation batch, for the same reason.
        mask_truncated_completions (`bool`, *optional*, defaults to `False`):
            Overlong filtering: truncated completions get no loss. Off, as in the paper's best run, which uses the
            soft overlong punishment below instead.
        vllm_importance_sampling_correction (`bool`, *optional*, defaults to `False`):
            With vLLM, its sampled logprobs are used directly as the old policy, so TRL's extra correction factor
            is off. `old_logprobs="recompute"` with `rollout_correction` is the same correction for every generation
            path (TRL's fields stay rejected).

        > Fields added by DAPO

        clip_ratio_c (`float` or `None`, *optional*, defaults to `10.0`):
            Dual-clip bound for negative advantages: a token's loss is at most `-clip_ratio_c * A`, so a very large
            ratio on a bad token cannot blow the loss up. `10.0` as in the reference 32B recipe; `None` disables it.
            Must be greater than 1.
        dynamic_sampling (`bool`, *optional*, defaults to `True`):
            Drop prompt groups whose filter metric is the same for all samples (all right or all wrong: zero
            advantage) and keep generating until the generation batch is full of informative groups.
        dynamic_sampling_metric (`str` or `None`, *optional*, defaults to `None`):
            What the filter looks at: the name of one reward function (default: the first one, i.e. task accuracy, as
            DAPO filters on accuracy rather than on the shaped reward), or `"reward"` for the weighted total.
        max_num_gen_batches (`int`, *optional*, defaults to `10`):
            Most candidate generation rounds per generation batch; `0` means unlimited.
        dynamic_sampling_on_limit (`str`, *optional*, defaults to `"train_on_partial"`):
            What to do when `max_num_gen_batches` rounds did not yield enough groups: `"train_on_partial"` trains on
            the informative groups found so far (the token-mean then runs over fewer tokens; nothing is padded) and,
            when there are none, skips the optimizer step with a warning and counts it in `dapo/skipped_steps`;
            `"raise"` stops with an error that says what was found. The reference recipe raises, and that crash is
            its most reported problem, so training on what was found is the default.
        dynamic_sampling_keep_surplus (`bool`, *optional*, defaults to `True`):
            Keep informative groups beyond the target for the next generation batch instead of discarding them.
        max_surplus_age (`int` or `None`, *optional*, defaults to `None`):
            Surplus groups older than this many optimizer steps are discarded (they grow off-policy; their rollout
            logprobs travel with them so the importance ratio stays right). `None` takes the optimizer steps of one
            generation batch (`steps_per_generation / gradient_accumulation_steps * num_iterations`), so a surplus
            group serves the generation batch right after its own and no later.
        dynamic_sampling_oversample (`str` or `float`, *optional*, defaults to `"1.0"`):
            Size of each candidate round relative to the groups still missing: a number (`1.0` = generate exactly
            what is missing) or `"auto"`, which divides by the running sampling efficiency so most generation batches
            need one round.
        dynamic_sampling_max_oversample (`float`, *optional*, defaults to `4.0`):
            Memory cap: a candidate round never exceeds this many times the generation batch's groups.
        dynamic_sampling_mode (`str`, *optional*, defaults to `"rounds"`):
            `"rounds"`: candidate rounds, each generated to its longest row, then scored and filtered. `"stream"`:
            one generation call per generation batch on the paged engine that scores each group as its last row
            ends, keeps or drops it at once and refills the freed decode slots with new prompts until the kept groups
            cover the batch (no round tail); its admissions are bounded by `max_num_gen_batches` x
            `dynamic_sampling_max_oversample` generation batches of groups (with `max_num_gen_batches=0`: one pass
            over the training set). Needs `rollout_engine="paged"` (or `"auto"` on CUDA) and reward functions that
            are plain callables.
        dynamic_sampling_in_flight (`str`, *optional*, defaults to `"finish"`):
            Stream mode: what happens to rows still decoding when the batch is full. `"finish"`: no new prompts, the
            rows in flight finish; their informative groups become surplus (with their rollout logprobs, bounded by
            `max_surplus_age`). `"drop"`: they are abandoned at once (their tokens are wasted, the step ends sooner).
            `"carry"`: the same as `partial_rollouts=True` (kept so that configs written before that field work).
        dynamic_sampling_stream_sync_every (`int`, *optional*, defaults to `1`):
            Stream mode: engine synchronisations (each `sync_every` decode steps) between two agreements of the
            ranks on the kept and in-flight counts (one small all-reduce); admissions and the end of the batch are
            decided there only, so the kept groups depend on the seed and the number of ranks, not on timing.
        partial_rollouts (`bool`, *optional*, defaults to `False`):
            Partial rollouts: a round of generation stops once the groups it must deliver have all ended (the
            generation batch's groups; with dynamic sampling, each candidate round's), while the engine keeps its
            decode slots busy with more groups than that; the groups still decoding are carried whole (their
            finished samples included) into the next round or generation batch and continued there under the weights
            then current, so no round waits for a tail of a few long rows. A group is trained once, when all its
            samples have ended; each token keeps the logprob of the policy that sampled it, which stays its old
            policy in the ratio (with `old_logprobs="recompute"`, `rollout_correction` weighs the tokens an earlier
            policy sampled like any other). Needs trl-dapo's engine (`rollout_engine="paged"`, or `"auto"` on CUDA).
            Rounds mode scores the delivered groups through TRL's method as usual; stream mode carries what is in
            flight when the batch is full (as `dynamic_sampling_in_flight="carry"`). Extra prompts come from the
            same stream dynamic sampling's extra rounds draw from. Off until the ablation measures its effect on
            learning.
        partial_rollout_max_in_flight (`float`, *optional*, defaults to `3.0`):
            Most groups in flight at once (admitted and not yet ended, carried ones included), in generation batches:
            it bounds how many optimizer steps old a trained group can be and how many rows are re-prefilled after
            each step. Must be greater than 1 (at 1 nothing is admitted beyond a batch, so nothing is carried).
        partial_rollout_max_age (`int` or `None`, *optional*, defaults to `None`):
            Optimizer steps a carried group may age (since it was first admitted) before it is dropped, untrained
            (`dapo/aged_out_groups`); `None`: never, the in-flight cap bounds the age.
        partial_rollout_keep_cache (`float`, *optional*, defaults to `0.0`):
            Share of the device's memory (the host's on the CPU) the KV cache of the carried rows may hold through the
            training step: when a round stops, the rows still decoding keep their KV pages (copied out of the
            engine's pool, which is freed) up to that many bytes, in the order they were admitted, and the next round
            continues them from it under the new weights instead of prefilling their prompt and tokens again (their
            earlier tokens' KV then stays the older weights', as in AReaL's partial rollouts; the per-token rollout
            logprobs and `rollout_correction` cover the policy mismatch). A row that does not fit, or finds no free
            slot or pages when it resumes, is prefilled as with `0.0` (off). Each stream's KV pool leaves that share
            free for the copy; the training passes run beside the kept cache: leave them room. Checkpoints do not hold it (a resumed run prefills). `dapo/carried_rows_kept_cache`
            and `dapo/carried_rows_reprefilled` count each way.
        overlong_buffer_len (`int` or `None`, *optional*, defaults to `None`):
            Soft overlong punishment buffer L_cache: completions longer than `max_completion_length -
            overlong_buffer_len` get a penalty growing linearly to `-overlong_penalty_factor` at
            `max_completion_length`. `None` takes a fifth of `max_completion_length` (DAPO: 4096 of 20480); `0`
            disables.
        overlong_penalty_factor (`float`, *optional*, defaults to `1.0`):
            Size of the overlong penalty at `max_completion_length`.
        rollout_engine (`str`, *optional*, defaults to `"auto"`):
            Generation path. `"paged"`: trl-dapo's continuous-batching engine over a paged KV cache (bf16 weight
            snapshot, CUDA-graph decode steps on CUDA), which returns the sampled tokens' logprobs; `"trl"`: TRL's
            own path (`generate`, vLLM, continuous batching); `"auto"`: `"paged"` on CUDA when the model type and
            set-up allow it, else TRL's, logging why.
        rollout_memory_fraction (`float`, *optional*, defaults to `0.85`):
            Share of the device's memory the process may hold while the engine generates: weights, optimizer state,
            weight snapshot, KV cache and workspace together. The KV cache takes what is left under it (rows wait or
            are preempted when it is full, never an out-of-memory error) and is freed when generation returns, so
            training can use that memory.
        rollout_max_rows (`int`, *optional*, defaults to `1024`):
            Decode slots of the engine: rows generated at once, each slot refilled as its row ends.
        rollout_kv_cache_dtype (`str`, *optional*, defaults to `"bf16"`):
            The paged engine's KV cache: `"bf16"` (the engine's dtype) or `"fp8"` (e4m3 with a float32 scale per
            token and KV head: about half the bytes, so twice the tokens in the same memory and half the reads per
            decode step). Needs CUDA of compute capability 8.9 or more, or the CPU (its reference attention). Like
            `rollout_weights_dtype="fp8"` it samples from a policy slightly off the training model's, so it needs
            `old_logprobs="recompute"` and a `rollout_correction` (`"token_mask"` recommended, see the README).
        rollout_weights_dtype (`str`, *optional*, defaults to `"bf16"`):
            The paged engine's decoder-layer linear weights: `"bf16"` or `"fp8"` (e4m3 with a scale per output
            channel, quantised from the bf16 snapshot, LoRA merged, at each weight sync; activations quantised per
            token; FP8 tensor cores through `torch._scaled_mm`). The output head stays bf16. Needs CUDA of compute
            capability 8.9 or more (Ada, Hopper), and like the FP8 cache a recomputed old policy and a correction.
        old_logprobs (`str`, *optional*, defaults to `"rollout"`):
            The old policy π_old of the ratio π_θ / π_old that Clip-Higher and the dual clip act on. `"rollout"`: the
            logprobs of the policy that sampled, as the generation engine returned them (no extra pass). `"recompute"`:
            the training model's own logprobs of the sampled tokens, computed once per generation batch before any
            update (one no-grad forward pass, micro-batched like training; rows whose logprobs TRL's own pass already
            computed under the current weights keep them), as the reference recipe does. The clip then acts on
            policy change alone, and `rollout_correction` can correct for the train/rollout mismatch.
        rollout_correction (`str` or `None`, *optional*, defaults to `None`):
            With `old_logprobs="recompute"`, each token's clipped loss is weighted (detached) by a function of ρ =
            π_old / π_rollout: `"token_truncate"` min(ρ_t, max) (TIS), `"token_mask"` ρ_t inside [min, max], 0 outside
            (MIS / IcePop), `"sequence_truncate"` / `"sequence_mask"` the same with ρ the geometric mean of the
            sequence's token ratios. `None`: no correction.
        rollout_correction_max (`float`, *optional*, defaults to `2.0`):
            The cap (truncate) or upper end of the band (mask); at least 1. verl's default cap is 2, IcePop's band
            ends at 5.
        rollout_correction_min (`float` or `None`, *optional*, defaults to `None`):
            The lower end: truncate clamps ρ from below at it too, mask drops tokens below it. `None`: no lower cap
            when truncating (TIS caps from above only), `1 / rollout_correction_max` when masking. IcePop uses 0.5.
        padding_free (`bool` or `None`, *optional*, defaults to `None`):
            The training passes (the loss's forward and backward, the old policy's recomputation, TRL's logprob
            passes and evaluation scoring) run on packed rows: each pass's prompts and completions concatenated with
            no padding, positions restarting on each row, attention kept within each row (PyTorch's variable-length
            flash attention on CUDA in bf16/fp16; elsewhere one SDPA call per row). Each optimizer step's rows are
            dealt to the ranks and to their passes by tokens rather than by rows. `None` turns it on where flash
            attention runs (CUDA with bf16 or fp16), since elsewhere the per-row calls cost more than the padding
            they save on short rows; `False` keeps padded passes: rows split evenly by count, each micro-batch padded
            to its longest row. Where the model cannot run packed (see the log), the padded passes run.
        padding_free_max_tokens (`int` or `None`, *optional*, defaults to `None`):
            Most tokens (prompt and completion) in one padding-free pass on one device, like verl's
            `ppo_max_token_len_per_gpu`: a micro-batch with more runs as several forward/backward passes, and a row
            longer than the cap trains alone. `None`: one pass per micro-batch (its share of the step's tokens). With
            `padding_free=False` a cap is an error; where the passes fall back to padded it does not apply, and a
            warning says so once.
        max_prompt_length (`int` or `None`, *optional*, defaults to `None`):
            Most tokens in a prompt (chat template included): a longer prompt is an error naming it, its length and
            the limit, before anything is generated from it (TRL 1.16 dropped its field of this name, which truncated:
            a truncated problem is another problem with the same ground truth). `None`: the model's
            `max_position_embeddings` less `max_completion_length`.
    """

    bf16: bool | None = field(
        default=None,
        metadata={
            "help": "bf16 mixed precision. Unset (None): on where bf16 can run (a bf16 GPU, XLA, or use_cpu), off "
            "elsewhere."
        },
    )
    epsilon: float = field(default=0.2, metadata={"help": "Lower clip range ε_low."})
    epsilon_high: float | None = field(default=0.28, metadata={"help": "Upper clip range ε_high (Clip-Higher)."})
    beta: float = field(default=0.0, metadata={"help": "KL coefficient; DAPO has none."})
    loss_type: str = field(default="dapo", metadata={"help": "Token-level loss; only 'dapo'."})
    num_generations: int | None = field(default=16, metadata={"help": "Samples per prompt (group size)."})
    per_device_train_batch_size: int = field(
        default=16, metadata={"help": "Completions per device and micro-batch (one group of 16)."}
    )
    per_device_eval_batch_size: int = field(
        default=16, metadata={"help": "Completions per device and evaluation batch (one group of 16)."}
    )
    mask_truncated_completions: bool = field(default=False, metadata={"help": "Overlong filtering."})
    vllm_importance_sampling_correction: bool = field(
        default=False, metadata={"help": "Off: vLLM's sampled logprobs are the old policy."}
    )

    clip_ratio_c: float | None = field(default=10.0, metadata={"help": "Dual-clip bound for negative advantages."})
    dynamic_sampling: bool = field(default=True, metadata={"help": "Filter uninformative prompt groups."})
    dynamic_sampling_metric: str | None = field(
        default=None, metadata={"help": "Reward function name to filter on, or 'reward' for the total."}
    )
    max_num_gen_batches: int = field(default=10, metadata={"help": "Most candidate rounds per batch; 0 = no limit."})
    dynamic_sampling_on_limit: str = field(
        default="train_on_partial",
        metadata={"help": "At the limit: 'train_on_partial' or 'raise'.", "choices": ON_LIMIT_CHOICES},
    )
    dynamic_sampling_keep_surplus: bool = field(default=True, metadata={"help": "Keep surplus groups for later."})
    max_surplus_age: int | None = field(
        default=None, metadata={"help": "Oldest surplus group kept, in optimizer steps; None = one generation batch."}
    )
    dynamic_sampling_oversample: str = field(
        default="1.0", metadata={"help": "Candidate round size factor, or 'auto' (from the sampling efficiency)."}
    )
    dynamic_sampling_max_oversample: float = field(
        default=4.0, metadata={"help": "Cap on a candidate round, in generation batches."}
    )
    dynamic_sampling_mode: str = field(
        default="rounds",
        metadata={
            "help": "'rounds' (candidate rounds) or 'stream' (refill slots as groups end).",
            "choices": SAMPLING_MODES,
        },
    )
    dynamic_sampling_in_flight: str = field(
        default="finish",
        metadata={
            "help": "Stream mode, rows in flight when full: 'finish', 'drop' or 'carry'.",
            "choices": IN_FLIGHT_CHOICES,
        },
    )
    dynamic_sampling_stream_sync_every: int = field(
        default=1, metadata={"help": "Stream mode: engine synchronisations between cross-rank agreements."}
    )
    partial_rollouts: bool = field(
        default=False, metadata={"help": "Stop a round once its groups ended; carry the rest to the next round."}
    )
    partial_rollout_max_in_flight: float = field(
        default=DEFAULT_MAX_IN_FLIGHT, metadata={"help": "Partial rollouts: most groups in flight, in batches (> 1)."}
    )
    partial_rollout_max_age: int | None = field(
        default=None, metadata={"help": "Partial rollouts: oldest carried group, in optimizer steps; None = no limit."}
    )
    partial_rollout_keep_cache: float = field(
        default=0.0,
        metadata={"help": "Partial rollouts: share of device memory carried rows' KV keeps through a step; 0: off."},
    )
    overlong_buffer_len: int | None = field(
        default=None, metadata={"help": "Soft overlong punishment buffer; None = a fifth of max_completion_length."}
    )
    overlong_penalty_factor: float = field(default=1.0, metadata={"help": "Overlong penalty at the max length."})
    rollout_engine: str = field(
        default="auto", metadata={"help": "'auto', 'paged' or 'trl'.", "choices": ROLLOUT_ENGINES}
    )
    rollout_memory_fraction: float = field(
        default=0.85, metadata={"help": "Share of device memory the process may hold while the engine generates."}
    )
    rollout_max_rows: int = field(default=1024, metadata={"help": "Rows the engine decodes at once."})
    rollout_kv_cache_dtype: str = field(
        default="bf16", metadata={"help": "Paged engine's KV cache: 'bf16' or 'fp8'.", "choices": ROLLOUT_PRECISIONS}
    )
    rollout_weights_dtype: str = field(
        default="bf16",
        metadata={"help": "Paged engine's linear weights: 'bf16' or 'fp8'.", "choices": ROLLOUT_PRECISIONS},
    )
    old_logprobs: str = field(
        default="rollout",
        metadata={
            "help": "Old policy of the ratio: the 'rollout' logprobs, or 'recompute' them with the training model.",
            "choices": OLD_LOGPROBS_CHOICES,
        },
    )
    rollout_correction: str | None = field(
        default=None,
        metadata={"help": "With old_logprobs='recompute': 'token_truncate', 'token_mask', 'sequence_truncate', "
                  "'sequence_mask' or None."},
    )  # fmt: skip
    rollout_correction_max: float = field(
        default=DEFAULT_CORRECTION_MAX, metadata={"help": "Cap (truncate) or upper band end (mask), at least 1."}
    )
    rollout_correction_min: float | None = field(
        default=None, metadata={"help": "Lower cap / band end; None = none (truncate), 1/max (mask)."}
    )
    padding_free: bool | None = field(
        default=None,
        metadata={
            "help": "Train on packed rows (no padding), micro-batches balanced by tokens; None: where flash attention "
            "runs (CUDA, bf16/fp16)."
        },
    )
    padding_free_max_tokens: int | None = field(
        default=None, metadata={"help": "Most tokens per padding-free forward/backward pass; None = no cap."}
    )
    max_prompt_length: int | None = field(
        default=None,
        metadata={"help": "Most prompt tokens; a longer prompt is an error naming it. None: the model's positions "
                  "less max_completion_length."},
    )  # fmt: skip

    def __post_init__(self) -> None:
        self._derived: dict[str, object] = {}  # fields left None and derived from others, with what they became
        self._check_dapo_fields()
        if self.bf16 is None and not self.fp16:
            # TRL turns bf16 on by default, and TrainingArguments then refuses to start where bf16 cannot run (a
            # machine without a bf16 GPU, unless use_cpu=True): turn it on only where it can run.
            self.bf16 = self.use_cpu or is_torch_bf16_gpu_available() or is_torch_xla_available()
        super().__post_init__()
        self._check_and_derive_after_trl()

    def checked_copy(self) -> DAPOConfig:
        """A copy the trainer owns, checked again: a notebook may change a field after construction (`c.beta = 0.5`),
        which no check would see. A field left None and derived from others (`overlong_buffer_len`, `epsilon_high`,
        `max_surplus_age`) is derived again from their current values unless it was set since; the caller's config
        is left as it is."""
        config = copy.copy(self)
        config._derived = {}
        for name, derived in getattr(self, "_derived", {}).items():  # none in a config pickled by an older version
            if getattr(self, name) == derived:
                setattr(config, name, None)
        config._check_dapo_fields()
        rows = config.per_device_train_batch_size * config.world_size * config.steps_per_generation
        if config.generation_batch_size != rows:
            raise invalid_value(
                "generation_batch_size",
                config.generation_batch_size,
                f"TRL derived it when the config was built, and per_device_train_batch_size "
                f"({config.per_device_train_batch_size}) x processes ({config.world_size}) x steps_per_generation "
                f"({config.steps_per_generation}) = {rows} now: a batch field changed since. Build a new DAPOConfig "
                "with the batch sizes you want.",
            )
        config._check_whole_groups()
        config._check_and_derive_after_trl()
        return config

    def _derive(self, name: str, value: object) -> None:
        setattr(self, name, value)
        self._derived[name] = value

    def _check_dapo_fields(self) -> None:
        """What is checked before TRL's and transformers' own `__post_init__` compares any value."""
        check_field_rules(self)  # types and ranges first: every later check, TRL's included, compares values
        self._reject_unhonoured_fields()
        self._validate_dapo_fields()

    def _check_and_derive_after_trl(self) -> None:
        """What needs TRL's derived batch fields (`steps_per_generation`)."""
        if self.steps_per_generation % self.gradient_accumulation_steps != 0:
            raise invalid_value(
                "steps_per_generation",
                self.steps_per_generation,
                f"it must be a multiple of gradient_accumulation_steps ({self.gradient_accumulation_steps}) so every "
                "optimizer step draws its micro-batches from one generation batch and its token count is known.",
            )
        if self.max_surplus_age is None:
            age = self.steps_per_generation // self.gradient_accumulation_steps * self.num_iterations
            self._derive("max_surplus_age", age)
        if self.overlong_buffer_len is None:
            self._derive("overlong_buffer_len", self.max_completion_length // 5)
        if self.overlong_buffer_len >= self.max_completion_length:
            raise invalid_value(
                "overlong_buffer_len",
                self.overlong_buffer_len,
                f"use 0 (off) or a value below max_completion_length ({self.max_completion_length}).",
            )

    def _reject_unhonoured_fields(self) -> None:
        """A GRPOConfig field DAPOTrainer does not honour, set away from its default, would be silently ignored."""
        for name, value, default, reason in unhonoured_settings(self):
            raise invalid_value(name, value, f"{reason}; leave it at its default {default!r}.")

    def _check_whole_groups(self) -> None:
        """Each generation batch (and each evaluation batch) must hold whole groups of `num_generations`: say which
        field to change, with values that work on this number of processes."""
        groups, world = self.num_generations, self.world_size
        step_rows = self.per_device_train_batch_size * world
        if self.generation_batch_size is not None and self.steps_per_generation is None:
            if self.generation_batch_size % groups:
                raise invalid_value(
                    "generation_batch_size",
                    self.generation_batch_size,
                    f"use a multiple of num_generations ({groups}).",
                )
            self._check_optimizer_steps_fit()
        else:
            steps = self.steps_per_generation or self.gradient_accumulation_steps
            if step_rows * steps % groups:
                rows_multiple = groups // math.gcd(groups, world * steps)
                steps_multiple = math.lcm(self.gradient_accumulation_steps, groups // math.gcd(groups, step_rows))
                raise invalid_value(
                    "per_device_train_batch_size",
                    self.per_device_train_batch_size,
                    f"a generation batch holds per_device_train_batch_size ({self.per_device_train_batch_size}) x "
                    f"processes ({world}) x steps_per_generation ({steps}) = {step_rows * steps} completions, not "
                    f"whole groups of num_generations={groups}. Set per_device_train_batch_size to a multiple of "
                    f"{rows_multiple} (the default 16 always works with num_generations=16), or steps_per_generation "
                    f"to a multiple of {steps_multiple}, or num_generations to a divisor of {step_rows * steps}.",
                )
        eval_groups = self.num_generations_eval or groups
        eval_rows = self.per_device_eval_batch_size * world
        if self.do_eval and self.eval_strategy != "no" and eval_rows % eval_groups:
            raise invalid_value(
                "per_device_eval_batch_size",
                self.per_device_eval_batch_size,
                f"an evaluation batch holds per_device_eval_batch_size x processes ({world}) = {eval_rows} "
                f"completions, not whole groups of {eval_groups} (num_generations_eval, else num_generations); use a "
                f"multiple of {eval_groups // math.gcd(eval_groups, world)}.",
            )

    def _check_optimizer_steps_fit(self) -> None:
        """A generation batch given in completions must split into whole optimizer steps on this number of processes
        (TRL's own error names neither the field to change nor the process counts that work)."""
        rows, world = self.generation_batch_size, self.world_size
        per_step = self.per_device_train_batch_size * self.gradient_accumulation_steps
        if rows % (per_step * world) == 0:
            return
        fixes = [
            f"generation_batch_size to a multiple of {math.lcm(per_step * world, self.num_generations)}",
        ]
        split = world * self.gradient_accumulation_steps
        if rows % split == 0:
            fixes.append(f"per_device_train_batch_size to a divisor of {rows // split}")
        elif rows >= math.lcm(
            split, self.num_generations
        ):  # no micro-batch size splits it: the nearest batch that does
            near = rows // math.lcm(split, self.num_generations) * math.lcm(split, self.num_generations)
            fixes.append(f"generation_batch_size={near} with per_device_train_batch_size a divisor of {near // split}")
        steps_per_process = rows // per_step if rows % per_step == 0 else 0
        counts = [count for count in range(1, steps_per_process + 1) if steps_per_process % count == 0]
        runs_on = f"; unchanged, these settings run on {_joined(counts)} processes" if counts else ""
        raise invalid_value(
            "generation_batch_size",
            rows,
            f"its {rows} completions must split into whole optimizer steps of per_device_train_batch_size "
            f"({self.per_device_train_batch_size}) x gradient_accumulation_steps ({self.gradient_accumulation_steps}) "
            f"x processes ({world}) = {per_step * world} completions. On {world} processes set {' or '.join(fixes)}"
            f"{runs_on}.",
        )

    def _validate_dapo_fields(self) -> None:
        """Reject settings that would silently stop this from being DAPO, naming the field and the fix."""
        if self.epsilon_high is None:
            self._derive("epsilon_high", self.epsilon)
        if self.epsilon_high < self.epsilon:
            raise invalid_value(
                "epsilon_high",
                self.epsilon_high,
                f"Clip-Higher needs epsilon_high >= epsilon ({self.epsilon}); DAPO uses 0.28 with 0.2.",
            )
        if self.dynamic_sampling_on_limit not in ON_LIMIT_CHOICES:
            raise invalid_value(
                "dynamic_sampling_on_limit", self.dynamic_sampling_on_limit, f"use one of {ON_LIMIT_CHOICES}."
            )
        if self.dynamic_sampling and self.scale_rewards not in ("group", "none", True, False):
            raise invalid_value(
                "scale_rewards",
                self.scale_rewards,
                "with dynamic sampling the advantage of a kept group must not depend on dropped groups; use 'group'.",
            )
        if self.dynamic_sampling and self.multi_objective_aggregation != "sum_then_normalize":
            raise invalid_value(
                "multi_objective_aggregation",
                self.multi_objective_aggregation,
                "it whitens the summed rewards over the whole candidate round, groups that dynamic sampling drops "
                "included, so a kept group's advantage would depend on them; use 'sum_then_normalize' (the "
                "reference recipe's) or dynamic_sampling=False.",
            )
        self.dynamic_sampling_oversample = self._parse_oversample(self.dynamic_sampling_oversample)
        if self.rollout_engine not in ROLLOUT_ENGINES:
            raise invalid_value("rollout_engine", self.rollout_engine, f"use one of {ROLLOUT_ENGINES}.")
        self._validate_sampling_mode()
        self._validate_partial_rollouts()
        self._validate_old_policy()
        self._validate_rollout_precision()
        if self.padding_free_max_tokens is not None and self.padding_free is False:
            raise invalid_value(
                "padding_free_max_tokens",
                self.padding_free_max_tokens,
                "it caps padding-free passes: set padding_free=True (or None) or leave it None.",
            )

    def _validate_sampling_mode(self) -> None:
        """Stream mode and its settings; a stream setting without stream mode would be ignored."""
        if self.dynamic_sampling_mode not in SAMPLING_MODES:
            raise invalid_value("dynamic_sampling_mode", self.dynamic_sampling_mode, f"use one of {SAMPLING_MODES}.")
        if self.dynamic_sampling_in_flight not in IN_FLIGHT_CHOICES:
            raise invalid_value(
                "dynamic_sampling_in_flight", self.dynamic_sampling_in_flight, f"use one of {IN_FLIGHT_CHOICES}."
            )
        if self.dynamic_sampling_mode == "rounds":
            if self.dynamic_sampling_in_flight == "carry":
                raise invalid_value(
                    "dynamic_sampling_in_flight",
                    "carry",
                    "it acts in stream mode only; rounds mode carries the rows in flight with partial_rollouts=True.",
                )
            self._refuse_unless_default(
                {"dynamic_sampling_in_flight": "finish", "dynamic_sampling_stream_sync_every": 1},
                "it acts in stream mode only: set dynamic_sampling_mode='stream' or leave it at its default.",
            )
            return
        if not self.dynamic_sampling:
            raise invalid_value(
                "dynamic_sampling_mode",
                "stream",
                "streaming is a way of doing dynamic sampling: set dynamic_sampling=True or use 'rounds'.",
            )
        if self.dynamic_sampling_oversample != "1.0":
            raise invalid_value(
                "dynamic_sampling_oversample",
                self.dynamic_sampling_oversample,
                "it sizes candidate rounds, which stream mode does not have (it admits groups from the running "
                "efficiency as slots free): leave it at '1.0', or use dynamic_sampling_mode='rounds'.",
            )
        self._check_paged_engine("dynamic_sampling_mode", "stream", "dynamic_sampling_mode='rounds'")

    def _validate_partial_rollouts(self) -> None:
        """Partial rollouts and their settings. Stream mode's `dynamic_sampling_in_flight="carry"` is the same switch:
        either turns both on; a partial-rollout setting without partial rollouts would be ignored."""
        if self.dynamic_sampling_in_flight == "carry":
            self.partial_rollouts = True
        if not self.partial_rollouts:
            self._refuse_unless_default(
                {
                    "partial_rollout_max_in_flight": DEFAULT_MAX_IN_FLIGHT,
                    "partial_rollout_max_age": None,
                    "partial_rollout_keep_cache": 0.0,
                },
                "it acts with partial_rollouts=True only: set that, or leave this at its default.",
            )
            return
        if self.dynamic_sampling_mode == "stream":
            if self.dynamic_sampling_in_flight == "drop":
                raise invalid_value(
                    "dynamic_sampling_in_flight",
                    "drop",
                    "partial_rollouts=True carries the rows in flight when the batch is full, which 'drop' abandons: "
                    "leave dynamic_sampling_in_flight at its default, or set partial_rollouts=False.",
                )
            self.dynamic_sampling_in_flight = "carry"
        self._check_paged_engine("partial_rollouts", True, "partial_rollouts=False")

    def _refuse_unless_default(self, defaults: dict[str, object], why: str) -> None:
        """Each field named in `defaults` at its default: it would be ignored here, which `why` says."""
        for name, default in defaults.items():
            if getattr(self, name) != default:
                raise invalid_value(name, getattr(self, name), why)

    def _check_paged_engine(self, name: str, value: object, otherwise: str) -> None:
        """`name` (at `value`) needs trl-dapo's paged engine: an engine choice that rules it out is an error here,
        before any model loads (what only the built trainer knows is checked at set-up, `set_up.py`)."""
        if self.rollout_engine == "trl" or self.use_vllm:
            engine = "use_vllm=True" if self.use_vllm else f"rollout_engine={self.rollout_engine!r}"
            raise invalid_value(
                name,
                value,
                f"it needs trl-dapo's paged engine (it keeps rows decoding across the engine's calls and refills its "
                f"decode slots), which {engine} does not use: set rollout_engine='paged' (or 'auto' on CUDA), or "
                f"{otherwise}.",
            )

    def _validate_old_policy(self) -> None:
        """The old-policy choice and its rollout correction; a threshold without a correction would be ignored."""
        if self.old_logprobs not in OLD_LOGPROBS_CHOICES:
            raise invalid_value("old_logprobs", self.old_logprobs, f"use one of {OLD_LOGPROBS_CHOICES}.")
        if self.rollout_correction is None:
            if self.rollout_correction_max != DEFAULT_CORRECTION_MAX or self.rollout_correction_min is not None:
                name = "rollout_correction_max" if self.rollout_correction_min is None else "rollout_correction_min"
                raise invalid_value(
                    name,
                    getattr(self, name),
                    "it only acts with a rollout_correction: set one (e.g. 'token_truncate') or leave it at its "
                    "default.",
                )
            return
        if self.rollout_correction not in CORRECTION_MODES:
            raise invalid_value(
                "rollout_correction", self.rollout_correction, f"use one of {CORRECTION_MODES} or None."
            )
        if self.old_logprobs != "recompute":
            raise invalid_value(
                "rollout_correction",
                self.rollout_correction,
                "it weighs tokens by π_old / π_rollout, which needs a recomputed old policy: set "
                "old_logprobs='recompute' (with the rollout logprobs as the old policy every weight would be 1).",
            )

    def _validate_rollout_precision(self) -> None:
        """FP8 rollouts: the paged engine generates, and the loss corrects for the policy FP8 samples from (off the
        training model's by its rounding) with a recomputed old policy and a rollout correction."""
        for name in ("rollout_kv_cache_dtype", "rollout_weights_dtype"):
            value = getattr(self, name)
            if value not in ROLLOUT_PRECISIONS:
                raise invalid_value(name, value, f"use one of {ROLLOUT_PRECISIONS}.")
            if value != "fp8":
                continue
            self._check_paged_engine(name, value, f"{name}='bf16'")
            if self.old_logprobs != "recompute" or self.rollout_correction is None:
                raise invalid_value(
                    name,
                    value,
                    "FP8 rollouts sample from a policy off the training model's (its rounding), which the loss must "
                    "correct for: set old_logprobs='recompute' and rollout_correction='token_mask' (tokens whose "
                    "π_old / π_rollout leaves [1/rollout_correction_max, rollout_correction_max] are masked), or "
                    f"{name}='bf16'.",
                )

    @staticmethod
    def _parse_oversample(value: str | float) -> str:
        """Keep the field a string for argument parsers, but check it names 'auto' or a finite number >= 1."""
        if str(value).strip().lower() == "auto":
            return "auto"
        try:
            number = float(value)
        except (TypeError, ValueError):
            number = math.nan
        if not 1.0 <= number < math.inf:
            raise invalid_value(
                "dynamic_sampling_oversample", value, "use 'auto' or a finite number >= 1, e.g. '1.0'."
            )
        return str(number)
