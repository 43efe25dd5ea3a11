"""A stand-in for vLLM at the seam TRL 1.16 calls, for the CPU tests of `DAPOTrainer(use_vllm=True)`.

TRL's own vLLM code runs (`trl.generation.vllm_generation.VLLMGeneration`: its colocate and server branches, its
weight sync, its logprob extraction); only what it calls is replaced: `vllm.LLM` and `SamplingParams` in colocate
mode, `VLLMClient` in server mode, and `is_vllm_available`. Both stand-ins sample from a copy of the model of their
own, loaded from the folder TRL names and changed only by TRL's weight sync, and answer in vLLM's shapes: the sampled
token ids and, per token, the sampled token's logprob. Those logprobs are the copy's shifted by `LOGPROB_SHIFT` on
purpose, so a test can tell them from the training model's.
"""

from __future__ import annotations

import contextlib
import http.server
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
from transformers import AutoModelForCausalLM

LOGPROB_SHIFT = -0.25

# (prompt token ids, the sample's index among the call's rows of that prompt) -> (completion ids, their logprobs)
Script = Callable[[list[int], int], tuple[list[int], list[float]]]


@dataclass
class Logprob:
    """vLLM's `vllm.logprobs.Logprob`."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]]


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]


class SamplingParams:
    """vLLM's `SamplingParams`: what the stand-ins read, the rest of TRL's settings accepted."""

    def __init__(self, n=1, temperature=1.0, max_tokens=16, logprobs=None, **rest) -> None:
        self.n, self.temperature, self.max_tokens, self.logprobs = n, temperature, max_tokens, logprobs


@dataclass
class Generation:
    """One generation call: its rows, and how far the stand-in's weights were then from the training model's (the
    largest difference of any parameter; None without a training model to compare with) and from the folder's."""

    prompts: list[list[int]]
    completions: list[list[int]]
    logprobs: list[list[float]]
    gap_to_training: float | None
    change_since_loaded: float


@dataclass
class Sampler:
    """The stand-ins' shared part: the model copy, its sampling, TRL's weight sync into it and a record of each call.
    `script`, when set, answers instead of sampling (the same rows as a `rollout_func` of that script);
    `training_model`, when set, is compared with the copy at each call."""

    model_path: str
    script: Script | None = None
    training_model: torch.nn.Module | None = None
    generations: list[Generation] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.model = AutoModelForCausalLM.from_pretrained(self.model_path).eval()
        self.loaded = {name: p.detach().clone() for name, p in self.model.named_parameters()}
        eos = self.model.generation_config.eos_token_id
        self.eos = set(eos if isinstance(eos, list) else [eos])
        self.generator = torch.Generator().manual_seed(0)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        parameters = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, tensor in weights:
                parameters[name].copy_(tensor)

    def generate(self, prompts: list[list[int]], samples: int, max_tokens: int, temperature: float):
        """`samples` rows per prompt, in order; each row's completion ids and logprobs."""
        rows = [list(prompt) for prompt in prompts for _ in range(samples)]
        if self.script is not None:
            indices = [sum(other == row for other in rows[:i]) for i, row in enumerate(rows)]
            answers = [self.script(row, index) for row, index in zip(rows, indices, strict=True)]
        else:
            by_row = {}
            for length in {len(row) for row in rows}:  # rows of one prompt length decode together
                chosen = [i for i, row in enumerate(rows) if len(row) == length]
                by_row.update(
                    zip(chosen, self._sample([rows[i] for i in chosen], max_tokens, temperature), strict=True)
                )
            answers = [by_row[i] for i in range(len(rows))]
        completions, logprobs = [ids for ids, _ in answers], [values for _, values in answers]
        self.generations.append(Generation(rows, completions, logprobs, *self._weight_gaps()))
        return answers

    @torch.no_grad()
    def _sample(self, prompts: list[list[int]], max_tokens: int, temperature: float):
        """Rows of one prompt length sampled together (no padding: a row that ended decodes on, unread)."""
        ids = torch.tensor(prompts)
        rows = [([], []) for _ in prompts]
        live = torch.ones(len(prompts), dtype=torch.bool)
        for _ in range(max_tokens):
            scores = (self.model(ids).logits[:, -1].float() / temperature).log_softmax(-1)
            tokens = torch.multinomial(scores.exp(), 1, generator=self.generator)
            picked = scores.gather(1, tokens)[:, 0] + LOGPROB_SHIFT
            for row, (completion, logprobs) in enumerate(rows):
                if live[row]:
                    completion.append(int(tokens[row]))
                    logprobs.append(float(picked[row]))
                    live[row] = completion[-1] not in self.eos
            if not live.any():
                break
            ids = torch.cat([ids, tokens], dim=1)
        return rows

    @torch.no_grad()
    def _weight_gaps(self) -> tuple[float | None, float]:
        """The largest difference of any parameter from the training model's (None without one) and from the weights
        loaded from the folder."""
        weights = dict(self.model.named_parameters())
        training = None
        if self.training_model is not None:
            training = max(
                float((weights[name] - p).abs().max()) for name, p in self.training_model.named_parameters()
            )
        loaded = max(float((weights[name] - p).abs().max()) for name, p in self.loaded.items())
        return training, loaded


class LLM:
    """`vllm.LLM` as TRL's colocate mode drives it: built from the model folder, `generate`, the weight loading TRL
    reaches through `llm_engine.model_executor.driver_worker.model_runner.model`, prefix cache and sleep calls."""

    def __init__(self, model: str, **settings) -> None:
        self.settings, self.sampling_params = settings, None
        self.sampler = Sampler(model)
        runner = SimpleNamespace(model=SimpleNamespace(load_weights=self.sampler.load_weights))
        self.llm_engine = SimpleNamespace(
            model_executor=SimpleNamespace(driver_worker=SimpleNamespace(model_runner=runner)),
            model_config=SimpleNamespace(max_model_len=settings.get("max_model_len")),
        )

    def generate(self, prompts: list[dict], sampling_params: SamplingParams, use_tqdm: bool = True):
        self.sampling_params = sampling_params
        rows = self.sampler.generate(
            [p["prompt_token_ids"] for p in prompts],
            sampling_params.n,
            sampling_params.max_tokens,
            sampling_params.temperature,
        )
        outputs = iter(rows)
        return [
            RequestOutput(
                p["prompt_token_ids"],
                [_completion(*next(outputs)) for _ in range(sampling_params.n)],
            )
            for p in prompts
        ]

    def reset_prefix_cache(self) -> None:
        pass

    def sleep(self, level: int = 1) -> None:
        pass

    def wake_up(self, tags: list[str] | None = None) -> None:
        pass


def _completion(ids: list[int], logprobs: list[float]) -> CompletionOutput:
    return CompletionOutput(
        ids, [{token: Logprob(logprob, rank=1)} for token, logprob in zip(ids, logprobs, strict=True)]
    )


class VLLMClient:
    """TRL's `VLLMClient` as server mode drives it; the served model and the server's `--logprobs-mode` are set on
    the class (`serving`), as a running server fixes them."""

    model_path: str = ""
    logprobs_mode: str = "processed_logprobs"

    def __init__(self, base_url=None, host="0.0.0.0", server_port=8000, group_port=51216, connection_timeout=0.0):
        self.sampler = Sampler(self.model_path)

    @classmethod
    def serving(cls, model_path: str, logprobs_mode: str = "processed_logprobs") -> type[VLLMClient]:
        return type("ServingClient", (cls,), {"model_path": model_path, "logprobs_mode": logprobs_mode})

    def init_communicator(self, device=None) -> None:
        pass

    def get_server_info(self) -> dict:
        return {"model_config": {"logprobs_mode": self.logprobs_mode}}

    def generate(self, prompts, features=None, n=1, temperature=1.0, max_tokens=16, logprobs=0, **rest) -> dict:
        rows = self.sampler.generate(prompts, n, max_tokens, temperature)
        return {
            "prompt_ids": prompts,
            "completion_ids": [ids for ids, _ in rows],
            "logprobs": [[[value] for value in logps] for _, logps in rows],
            "logprob_token_ids": [[[token] for token in ids] for ids, _ in rows],
        }

    def update_named_params(self, metadata, params: Iterator[tuple[str, torch.Tensor]]) -> None:
        self.sampler.load_weights(params)

    def reset_prefix_cache(self) -> None:
        pass


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


@contextlib.contextmanager
def health_endpoint() -> Iterator[str]:
    """A local server answering `/health` as a running vLLM server does (the trainer asks it before TRL's client is
    built, `vllm_path.py`); yields its base URL, for `vllm_server_base_url`."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


DISTRIBUTED_ENVIRONMENT = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def install(monkeypatch, server: type[VLLMClient] | None = None) -> None:
    """Put the stand-ins where TRL's vLLM code looks them up (`server`: the client class server mode builds), and undo
    at the test's end the environment TRL's colocate mode sets for vLLM's launcher (ranks, rendezvous), which would
    make later trainers in this process believe they run distributed."""
    import trl.generation.vllm_generation as vllm_generation

    monkeypatch.setattr(vllm_generation, "is_vllm_available", lambda *args, **kwargs: True)
    monkeypatch.setattr(vllm_generation, "LLM", LLM, raising=False)
    monkeypatch.setattr(vllm_generation, "SamplingParams", SamplingParams, raising=False)
    monkeypatch.setattr(vllm_generation, "VLLMClient", server or VLLMClient)
    for name in DISTRIBUTED_ENVIRONMENT:
        monkeypatch.setenv(name, os.environ.get(name, ""))  # recorded: restored (or removed) when the test ends
        monkeypatch.delenv(name)
