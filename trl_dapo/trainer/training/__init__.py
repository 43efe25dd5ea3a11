"""Training on a collected batch: its micro-batches and passes (packed or padded forwards, the old policy's
recomputation), the pure DAPO loss and the rollout correction, an empty step's skipped update, and the metrics of
the step and of the trained batch. It imports `configuration` alone of the trainer's parts, never `collection`: the
trainer's side hands it the batch; `safety` builds on it."""

from .batch_metrics import append_metrics, rollout_metrics, trained_batch_metric_names, trained_batch_metrics
from .deepspeed_skip import skip_next_update
from .loss import dapo_policy_loss
from .micro_batches import MicroBatch, micro_batch_states, micro_batches_from_states
from .passes import TrainingPasses, set_up_padding_free

__all__ = [
    "MicroBatch",
    "TrainingPasses",
    "append_metrics",
    "dapo_policy_loss",
    "micro_batch_states",
    "micro_batches_from_states",
    "rollout_metrics",
    "set_up_padding_free",
    "skip_next_update",
    "trained_batch_metric_names",
    "trained_batch_metrics",
]
