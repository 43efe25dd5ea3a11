"""DAPO on TRL's vLLM path (`use_vllm=True`): what it needs of vLLM beyond what TRL checks.

TRL generates (colocate: `vllm.LLM` in the trainer's process; server: `VLLMClient`), syncs the weights before the
first generation of each optimizer step, and returns vLLM's logprob of each sampled token as
`sampling_per_token_logps`. DAPOTrainer takes those as the old policy of every ratio (`old_logprobs="rollout"`) or as
the rollout policy its correction divides by (`"recompute"`), whatever TRL's own importance-sampling correction (off,
and rejected). So they must be the logprobs of the distribution vLLM sampled from: after temperature and logit
processing, vLLM's `processed_logprobs` mode. TRL builds colocate mode's engine in that mode; a server fixes its own
when it starts, and TRL asks it only when its correction is on.
"""

from __future__ import annotations

from accelerate.utils import broadcast_object_list

SAMPLED_LOGPROBS_MODE = "processed_logprobs"


def check_vllm_server_logprobs(args, vllm_generation, accelerator) -> None:
    """In server mode, the server's logprobs are those of the distribution it samples from (every rank raises)."""
    if not args.use_vllm or args.vllm_mode != "server":
        return
    mode = [None]
    if accelerator.is_main_process:  # the one process that holds a client
        mode = [vllm_generation.vllm_client.get_server_info()["model_config"]["logprobs_mode"]]
    broadcast_object_list(mode, from_process=0)
    if mode[0] != SAMPLED_LOGPROBS_MODE:
        raise ValueError(
            f"DAPOConfig.use_vllm=True with vllm_mode='server': the vLLM server runs with --logprobs-mode "
            f"{mode[0]}, so what it returns is not each token's logprob under the distribution it sampled from "
            "(after temperature and logit processing), which DAPOTrainer takes as the old policy of the ratio (with "
            "old_logprobs='recompute', as the rollout policy the correction divides by). Restart the server with "
            f"--logprobs-mode {SAMPLED_LOGPROBS_MODE} (`trl vllm-serve` sets it)."
        )
