"""DAPO on TRL's vLLM path (`use_vllm=True`): what it needs of vLLM beyond what TRL checks.

TRL generates (colocate: `vllm.LLM` in the trainer's process; server: `VLLMClient`), syncs the weights before the
first generation of each optimizer step, and returns vLLM's logprob of each sampled token as
`sampling_per_token_logps`. DAPOTrainer takes those as the old policy of every ratio (`old_logprobs="rollout"`) or as
the rollout policy its correction divides by (`"recompute"`), whatever TRL's own importance-sampling correction (off,
and rejected). So they must be the logprobs of the distribution vLLM sampled from: after temperature and logit
processing, vLLM's `processed_logprobs` mode. TRL builds colocate mode's engine in that mode; a server fixes its own
when it starts, and TRL asks it only when its correction is on.

Before any model loads (`check_vllm_set_up`): vLLM must be installed (TRL's own error came after the model had loaded,
and its install line, `pip install trl[vllm]`, takes the newest vLLM TRL admits, which this package has not run), and
a server must answer. TRL's check of the server (`VLLMClient.check_server`) asks `/health` with no timeout, so a server
that accepted the connection and never answered hung the trainer's set-up past `vllm_server_timeout`; here each ask
is bounded by what is left of it.
"""

from __future__ import annotations

import time

import requests
from accelerate.utils import broadcast_object_list
from trl.generation import vllm_generation

SAMPLED_LOGPROBS_MODE = "processed_logprobs"
VLLM_INSTALL = 'pip install "trl-dapo[vllm]"'
RETRY_SECONDS = 2.0  # between asks of a server not up yet, as TRL's own check


def server_url(args) -> str:
    """The server TRL's client reaches: `vllm_server_base_url`, else `http://{vllm_server_host}:{vllm_server_port}`."""
    if args.vllm_server_base_url is not None:
        return args.vllm_server_base_url.rstrip("/")
    return f"http://{args.vllm_server_host}:{args.vllm_server_port}"


def wait_for_vllm_server(args) -> None:
    """The server answers `/health` with 200 within `vllm_server_timeout` seconds, each ask bounded by the time
    left; else a `ConnectionError` naming the server, the timeout and what it did last."""
    url, timeout = server_url(args), args.vllm_server_timeout
    deadline, last = time.monotonic() + timeout, "nothing was asked"
    while (left := deadline - time.monotonic()) > 0:
        try:
            status = requests.get(f"{url}/health", timeout=left).status_code
        except requests.exceptions.ConnectTimeout:
            last = "the connection was not accepted in time"
        except requests.exceptions.Timeout:
            last = "it accepted the connection but sent no answer"
        except requests.exceptions.RequestException as error:
            last = f"no connection ({type(error).__name__})"
        else:
            if status == 200:
                return
            last = f"it answered HTTP {status}"
        time.sleep(min(RETRY_SECONDS, max(deadline - time.monotonic(), 0.0)))
    raise ConnectionError(
        f"DAPOConfig.use_vllm=True with vllm_mode='server': the vLLM server at {url} did not answer {url}/health "
        f"within vllm_server_timeout={timeout:g} s ({last}). Start it (`trl vllm-serve --model ...`), check "
        "vllm_server_base_url (or vllm_server_host and vllm_server_port), or raise vllm_server_timeout while it "
        "loads."
    )


def check_vllm_set_up(args) -> None:
    """With `use_vllm`: vLLM is installed (as TRL finds it), and in server mode the server answers (every process
    asks), before any model loads."""
    if not args.use_vllm:
        return
    if not vllm_generation.is_vllm_available():
        raise ImportError(
            f"DAPOConfig.use_vllm=True needs vLLM, which is not installed in this environment. Install the version "
            f"this package is tested with: `{VLLM_INSTALL}` (vLLM 0.26.0, which needs torch 2.11.0 and a CUDA GPU; "
            "docs/vllm.md). TRL's `pip install trl[vllm]` takes the newest vLLM TRL admits, which this package has "
            "not run. Or set use_vllm=False: the paged engine generates without vLLM."
        )
    if args.vllm_mode == "server":
        wait_for_vllm_server(args)


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
