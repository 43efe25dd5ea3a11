"""`DAPOConfig`: TRL's `GRPOConfig` with the DAPO recipe's defaults and the fields DAPO adds."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from transformers.utils import is_torch_bf16_gpu_available, is_torch_xla_available
from trl import GRPOConfig

from .batch_sizes import GenerationBatchCheck, check_batch_unchanged, check_steps_per_generation, check_whole_groups
from .checkpointing import hand_on_checkpointing
from .choices import (
    DEFAULT_CORRECTION_MAX,
    DEFAULT_MAX_IN_FLIGHT,
    IN_FLIGHT_CHOICES,
    OLD_LOGPROBS_CHOICES,
    ON_LIMIT_CHOICES,
    ROLLOUT_ENGINES,
    ROLLOUT_PRECISIONS,
    SAMPLING_MODES,
    check_choices,
)
from .field_rules import check_field_rules, check_generation_kwargs, check_numeric_fields, invalid_value
from .grpo_fields import reject_unhonoured_settings


@dataclass
class DAPOConfig(GRPOConfig, GenerationBatchCheck):
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
            soft overlong punishment (`overlong_buffer_len`) instead.
        vllm_importance_sampling_correction (`bool`, *optional*, defaults to `False`):
            With vLLM, its sampled logprobs are used directly as the old policy, so TRL's extra correction factor
            is off. `old_logprobs="recompute"` with `rollout_correction` is the same correction for every generation
            path (TRL's fields stay rejected). [vLLM](vllm.md#what-dapotrainer-does-on-vllm) says what differs there.

        > Fields added by DAPO

        clip_ratio_c (`float` or `None`, *optional*, defaults to `10.0`):
            Dual-clip bound for negative advantages: a token's loss is at most `-clip_ratio_c * A`, so a very large
            ratio on a bad token cannot blow the loss up. `10.0` as in the reference 32B recipe; `None` disables it.
            Must be greater than 1.
        dynamic_sampling (`bool`, *optional*, defaults to `True`):
            Drop prompt groups whose filter metric is the same for all samples (all right or all wrong: zero
            advantage) and keep generating until the generation batch is full of informative groups.
        dynamic_sampling_metric (`str` or `None`, *optional*, defaults to `None`):
            What the filter looks at: the name of one reward function, or `"reward"` for the weighted total. `None`
            takes the one reward function given (task accuracy: DAPO filters on it rather than on the shaped reward);
            with several, `None` is an error asking which.
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
            need one round. On one H200 (2026-12-02, Qwen2.5-0.5B, 16 prompts x 8), `"auto"` took 4.7x fewer rounds
            per step than `"1.0"` with half the groups uninformative, 8.3x fewer with 80%
            ([performance](performance.md#under-zero-3-and-what-dynamic-sampling-costs)). Rounds mode only: stream
            mode has no rounds and refuses any other value than `"1.0"`.
        dynamic_sampling_max_oversample (`float`, *optional*, defaults to `4.0`):
            Memory cap, in generation batches of groups: a candidate round never holds more. In stream mode it caps
            the groups in flight at once instead (with `partial_rollouts=True`, `partial_rollout_max_in_flight` does),
            and `max_num_gen_batches` times it bounds a stream's admissions.
        dynamic_sampling_mode (`str`, *optional*, defaults to `"rounds"`):
            `"rounds"`: candidate rounds, each generated to its longest row, then scored and filtered. `"stream"`:
            one generation call per generation batch on the paged engine that scores each group as its last row
            ends, keeps or drops it at once and refills the freed decode slots with new prompts until the kept groups
            cover the batch (no round tail); its admissions are bounded by `max_num_gen_batches` x
            `dynamic_sampling_max_oversample` generation batches of groups (with `max_num_gen_batches=0`: one pass
            over the training set). Needs `rollout_engine="paged"` (or `"auto"` on CUDA) and reward functions that
            are plain callables ([design](design.md#streaming-dynamic-sampling)).
        dynamic_sampling_in_flight (`str`, *optional*, defaults to `"finish"`):
            Stream mode: what happens to rows still decoding when the batch is full. `"finish"`: no new prompts, the
            rows in flight finish; their informative groups become surplus (with their rollout logprobs, bounded by
            `max_surplus_age`). `"drop"`: they are abandoned at once (their tokens are wasted, the step ends sooner).
            `"carry"`: they are carried into the next batch's stream, the same switch as `partial_rollouts=True`
            (either sets the other; kept so that configs written before that field work).
        dynamic_sampling_stream_sync_every (`int`, *optional*, defaults to `1`):
            Stream mode: engine synchronisations (up to 32 decode steps each) between two agreements of the ranks on
            the kept and in-flight counts (one small all-reduce); admissions and the end of the batch are decided
            there only, so the kept groups depend on the seed and the number of ranks, not on timing. A larger value
            makes fewer all-reduces, and freed slots wait longer for new prompts.
        partial_rollouts (`bool`, *optional*, defaults to `False`):
            Partial rollouts: a round of generation stops once the groups it must deliver have all ended (rounds
            mode: the generation batch's groups, or with dynamic sampling each candidate round's; stream mode: once
            the kept groups cover the batch), while the engine keeps its decode slots busy with more groups than
            that, so no round waits for a tail of a few long rows. The groups still decoding are carried whole (their
            finished samples included) into the next round or generation batch, which resumes them first, under the
            weights then current: their prompt and tokens are prefilled again (unless `partial_rollout_keep_cache`
            kept their KV). A group is trained once, when all its samples have ended; each token keeps the logprob
            of the policy that sampled it, which stays its old policy in the ratio (with `old_logprobs="recompute"`,
            `rollout_correction` weighs the tokens an earlier policy sampled like any other). Carried groups are
            saved with checkpoints (every rank's; dealt anew when resumed on another number of ranks). Needs
            trl-dapo's engine (`rollout_engine="paged"`, or `"auto"` on CUDA). Rounds mode scores the delivered
            groups through TRL's method as usual; stream mode carries what is in flight when the batch is full (as
            `dynamic_sampling_in_flight="carry"`). Extra prompts come from the same stream dynamic sampling's extra
            rounds draw from. On one H100 (2026-12-05, a 1.5B model, 8 x 16 completions up to 8,192 tokens) a step
            took 0.85x a plain round's ([performance](performance.md#what-do-partial-rollouts-and-kept-kv-buy)).
            Off until a study shows it costs no learning ([design](design.md#partial-rollouts)).
        partial_rollout_max_in_flight (`float`, *optional*, defaults to `3.0`):
            Most groups in flight at once (admitted and not yet ended, carried ones included), in generation batches:
            it bounds how many optimizer steps old a trained group can be and how many rows are prefilled again after
            each step. A generation batch's dataloader prompts enter its first round whatever the cap. The decode
            slots are `rollout_max_rows`: set above the completions per step, a round fills the slots beyond its
            batch's rows with further prompts (from the extra-prompt stream dynamic sampling uses), within this cap.
            In stream mode it replaces `dynamic_sampling_max_oversample` as the cap on groups in flight. Must be
            greater than 1 (at 1 nothing is admitted beyond a batch, so nothing is carried).
        partial_rollout_max_age (`int` or `None`, *optional*, defaults to `None`):
            Optimizer steps a carried group may age (since it was first admitted) before it is dropped, untrained
            (`dapo/aged_out_groups`); `None`: never, the in-flight cap bounds the age.
        partial_rollout_keep_cache (`float`, *optional*, defaults to `0.0`):
            Share of the device's memory (the host's on the CPU) the KV cache of the carried rows may hold through the
            training step. When a round stops, the rows still decoding keep their KV pages: copied out of the
            engine's pool (which is freed) in the order they were admitted, within that share and what
            `rollout_memory_fraction` leaves beside the pool; a row that does not fit is skipped. The next round
            continues them from it under the new weights instead of prefilling their prompt and tokens again (their
            earlier tokens' KV then stays the older weights', as in AReaL's partial rollouts; the per-token rollout
            logprobs and `rollout_correction` cover the policy mismatch). A row that did not fit, or finds no free
            slot or pages when it resumes, is prefilled as with `0.0` (off). Each stream's KV pool leaves that share
            free for the copy, so the pool is smaller by it; the training passes run beside the kept cache: leave
            them room. Not saved with checkpoints (a resumed run prefills). `dapo/carried_rows_kept_cache` and
            `dapo/carried_rows_reprefilled` count each way. Not measured on a GPU yet
            ([performance](performance.md#what-do-partial-rollouts-and-kept-kv-buy)).
        overlong_buffer_len (`int` or `None`, *optional*, defaults to `None`):
            Soft overlong punishment buffer L_cache: completions longer than `max_completion_length -
            overlong_buffer_len` get a penalty growing linearly to `-overlong_penalty_factor` at
            `max_completion_length`. `None` takes a fifth of `max_completion_length` (DAPO: 4096 of 20480); `0`
            disables.
        overlong_penalty_factor (`float`, *optional*, defaults to `1.0`):
            Size of the overlong penalty at `max_completion_length`.
        rollout_engine (`str`, *optional*, defaults to `"auto"`):
            Generation path. `"paged"`: trl-dapo's continuous-batching engine over a paged KV cache, which returns the
            sampled tokens' logprobs (on CUDA a bf16 weight snapshot, CUDA-graph decode steps and a Triton
            decode-attention kernel; on the CPU float32 and a PyTorch reference attention); `"trl"`: TRL's own path
            (`generate`, vLLM, continuous batching); `"auto"`: `"paged"` on CUDA when the model and set-up allow it,
            else TRL's, logging why. The engine serves Llama, Mistral, Qwen2 and Qwen3 models, except with options it
            does not implement (Llama's `attention_bias` or `mlp_bias`, an activation other than SiLU, a sliding
            window shorter than the context), and no multimodal model; vLLM, a `rollout_func`, tool calling,
            transformers' continuous batching, `min_p`, `repetition_penalty`, `generation_kwargs` beyond the sampling
            ones, FSDP1 or ZeRO-3 with `ds3_gather_for_generation=False` rule it out too. `"paged"` where it cannot
            serve is an error when the trainer is built, and so is `"auto"` falling back with FP8 rollouts (TRL's path
            would ignore them). Under ZeRO-3 and FSDP2 its snapshot is gathered from the shards one layer at a time.
            Its logits take the training head's precision (float32 with `cast_lm_head_to_fp32=True`)
            ([design](design.md#the-rollout-engine)).
        rollout_memory_fraction (`float`, *optional*, defaults to `0.85`):
            Share of the device's memory the process may hold while the engine generates: weights, optimizer state,
            weight snapshot, KV cache and workspace together. The KV cache takes what is left under it (rows wait or
            are preempted when it is full, never an out-of-memory error) and is freed when generation returns, so
            training can use that memory.
        rollout_max_rows (`int`, *optional*, defaults to `1024`):
            Decode slots of the engine: rows generated at once, each slot refilled as its row ends. With partial
            rollouts the slots beyond a generation batch's rows take further prompts, within
            `partial_rollout_max_in_flight`.
        rollout_kv_cache_dtype (`str`, *optional*, defaults to `"bf16"`):
            The paged engine's KV cache: `"bf16"` (the engine's dtype; float32 on the CPU) or `"fp8"` (e4m3 with a
            float32 scale per token and KV head, written quantised by the prefill and the decode kernel and read
            dequantised: about half the bytes, so twice the tokens in the same memory and half the cache reads per
            decode step). Needs CUDA of compute capability 8.9 or more (Ada, Hopper), or the CPU with
            `rollout_engine="paged"` (its reference attention). Like `rollout_weights_dtype="fp8"` it samples from a
            policy slightly off the training model's, so it needs `old_logprobs="recompute"` and a
            `rollout_correction` (`"token_mask"` recommended: [FP8 rollouts](dapo-config-guide.md#fp8-rollouts)).
            Off by default: on one H100 (2026-12-06) it was not faster than bf16
            ([performance](performance.md#what-did-not-pay-fp8)).
        rollout_weights_dtype (`str`, *optional*, defaults to `"bf16"`):
            The paged engine's decoder-layer linear weights: `"bf16"` or `"fp8"` (e4m3 with a scale per output
            channel, quantised from the bf16 snapshot, LoRA merged, at each weight sync; activations quantised per
            token; FP8 tensor cores through `torch._scaled_mm`). The output head stays bf16. Needs CUDA of compute
            capability 8.9 or more (Ada, Hopper), elsewhere an error when the trainer is built, before the model
            loads; and linear layers whose sizes are multiples of 16. Like the FP8 cache it needs a recomputed old
            policy and a correction ([FP8 rollouts](dapo-config-guide.md#fp8-rollouts)).
        old_logprobs (`str`, *optional*, defaults to `"rollout"`):
            The old policy π_old of the ratio π_θ / π_old that Clip-Higher and the dual clip act on. `"rollout"`: the
            logprobs of the policy that sampled, as the generation engine returned them (no extra pass). `"recompute"`:
            the training model's own logprobs of the sampled tokens, computed once per generation batch before any
            update (one no-grad forward pass, micro-batched like training; rows whose logprobs TRL's own pass already
            computed under the current weights keep them), as the reference recipe does. The clip then acts on
            policy change alone, and `rollout_correction` can correct for the train/rollout mismatch
            ([which to use](design.md#which-to-use)).
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
            they save on short rows; `True` packs anywhere; `False` keeps padded passes: rows split evenly by count,
            each micro-batch padded to its longest row. Where the model or set-up cannot run packed (a multimodal
            model, sliding-window attention, layers other than full attention, ...), the padded passes run and the
            log says why: an INFO line for `None` off CUDA, else a warning ([log lines](metrics.md#log-lines)). On
            one H200 (2026-12-04) padded passes took 3.9-5.6x the packed ones' training time at DAPO's lengths
            ([performance](performance.md#padding-free-training-against-padded-passes),
            [design](design.md#padding-free-training)).
        padding_free_max_tokens (`int` or `None`, *optional*, defaults to `None`):
            Most tokens (prompt and completion) in one padding-free pass on one device, like verl's
            `ppo_max_token_len_per_gpu`: a micro-batch with more runs as several forward/backward passes, and a row
            longer than the cap trains alone. `None`: one pass per micro-batch (its share of the step's tokens). With
            `padding_free=False` a cap is an error; where the passes fall back to padded (`padding_free=None` off
            CUDA, a model that cannot pack) it does not apply, and a warning says so once.
        max_prompt_length (`int` or `None`, *optional*, defaults to `None`):
            Most tokens in a prompt (chat template included): a longer prompt is an error naming it (its position in
            the batch and its start), its length and the limit, before anything is generated from it (TRL 1.16
            dropped its field of this name, which truncated: a truncated problem is another problem with the same
            ground truth). `None`: the model's `max_position_embeddings` less `max_completion_length`.
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
        hand_on_checkpointing(self)  # TRL sets gradient_checkpointing, which transformers 5.25 renamed
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
        check_batch_unchanged(config)
        check_whole_groups(config)
        config._check_and_derive_after_trl()
        return config

    def _derive(self, name: str, value: object) -> None:
        setattr(self, name, value)
        self._derived[name] = value

    def _check_dapo_fields(self) -> None:
        """What is checked before TRL's and transformers' own `__post_init__` compares any value."""
        check_field_rules(self)  # types and ranges first: every later check, TRL's included, compares values
        reject_unhonoured_settings(self)
        check_numeric_fields(self)  # every other number: the Trainer's and TRL's (save_steps...), finite
        if self.epsilon_high is None:
            self._derive("epsilon_high", self.epsilon)
        check_choices(self)  # `choices.py`

    def _check_and_derive_after_trl(self) -> None:
        """What needs TRL's derived batch fields (`steps_per_generation`) or the dicts its `__post_init__` reads from
        JSON strings (`generation_kwargs`)."""
        check_steps_per_generation(self)
        check_generation_kwargs(self)
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
