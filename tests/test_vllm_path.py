"""DAPO on TRL's vLLM path (`use_vllm=True`), on the CPU: the real `DAPOTrainer` and TRL's own vLLM code, with vLLM
itself replaced at the seam TRL calls (`tests/vllm_stub.py`: `vllm.LLM` in colocate mode, `VLLMClient` in server
mode) by a stand-in that samples from its own copy of the tiny model, takes TRL's weight sync, and returns logprobs
shifted by `LOGPROB_SHIFT` from the model's, so the old policy can be told apart.

Checked: dynamic sampling drops the constant groups and draws more rounds; the soft overlong penalty enters the
advantages; the ratio's old policy is the logprobs vLLM returned (surplus groups keep theirs); with
`old_logprobs="recompute"` they are the rollout policy the correction divides by; the weights are synced before each
generation; given the same completions and rewards the vLLM path trains exactly as a `rollout_func` path does (the
same groups kept, advantages, losses and weights); server mode likewise, and a server whose logprobs are not the
sampled distribution's is refused; what needs the paged engine is refused with vLLM.
"""

import logging
import math
import re

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from vllm_stub import LOGPROB_SHIFT, VLLMClient, health_endpoint, install

from helpers import arithmetic_prompts, dapo_args, record_batches, rows_of, teacher_forced_logprobs, trained_rows
from trl_dapo import DAPOTrainer
from trl_dapo.rewards import soft_overlong_penalty
from trl_dapo.testing import ScriptedRollout
from trl_dapo.trainer.set_up import check_set_up

EVAL_PROMPTS = arithmetic_prompts(4, offset=40)  # "What is a + 4 ?": none of the 40 training prompts


def even_prompts_constant(completion_ids, index, **kwargs) -> list[float]:
    """1.0 for every sample of an even-indexed prompt (a constant group: filtered); 0, 1, 0, 1 down the rows of the
    others (each group of 4 varies)."""
    return [1.0 if i % 2 == 0 else float(row % 2) for row, i in enumerate(index)]


def even_prompts_constant_else_length(completion_ids, index, **kwargs) -> list[float]:
    return [1.0 if i % 2 == 0 else float(len(ids) % 2) for ids, i in zip(completion_ids, index, strict=True)]


def prompt_index(tokenizer, prompt_ids: list[int]) -> int:
    """The training prompt's row: `arithmetic_prompts` asks "What is {i % 10} + {i // 10} ?" for i < 100."""
    a, b = re.search(r"What is (\d) \+ (\d) \?", tokenizer.decode(prompt_ids)).groups()
    return int(a) + 10 * int(b)


def vllm_trainer(model: str, output, reward=even_prompts_constant, eval_dataset=None, **overrides) -> DAPOTrainer:
    settings = dict(use_vllm=True, per_device_train_batch_size=8, learning_rate=0.1, max_steps=2) | overrides
    return DAPOTrainer(
        model=model, reward_funcs=reward, args=dapo_args(output, **settings), train_dataset=arithmetic_prompts(40),
        eval_dataset=eval_dataset,
    )  # fmt: skip


def returned_logprobs(sampler) -> dict[tuple, list[float]]:
    """What the stand-in returned for each (prompt, completion) it generated."""
    rows = {}
    for generation in sampler.generations:
        for prompt, completion, logprobs in zip(
            generation.prompts, generation.completions, generation.logprobs, strict=True
        ):
            assert (tuple(prompt), tuple(completion)) not in rows, "two samples alike: the lookup would be ambiguous"
            rows[tuple(prompt), tuple(completion)] = logprobs
    return rows


def assert_old_policy_is_vllms(batch: dict, returned: dict, key: str = "old_per_token_logps") -> None:
    for row, (prompt, completion) in enumerate(rows_of(batch)):
        expected = torch.tensor(returned[tuple(prompt), tuple(completion)])
        torch.testing.assert_close(batch[key][row, : len(completion)], expected, atol=1e-6, rtol=0)


def logged(trainer, name) -> list[float]:
    return [h[name] for h in trainer.state.log_history if name in h]


def test_colocate_runs_dapo_with_vllms_logprobs_as_the_old_policy(tiny_model, tmp_path, monkeypatch, caplog):
    install(monkeypatch)
    with caplog.at_level(logging.INFO, logger="trl_dapo"):
        trainer = vllm_trainer(
            tiny_model, tmp_path, max_steps=3, overlong_buffer_len=4, dynamic_sampling_oversample="2.0",
            eval_dataset=EVAL_PROMPTS, eval_strategy="steps", eval_steps=2,
        )  # fmt: skip
    assert "use_vllm=True: vLLM generates (TRL's path), not the paged engine." in caplog.messages
    assert not [record for record in caplog.records if record.levelno >= logging.WARNING]
    llm = trainer.vllm_generation.llm
    llm.sampler.training_model = trainer.model
    batches = record_batches(trainer)
    trainer.train()
    tokenizer = trainer.processing_class
    # TRL asked vLLM for the logprob of each sampled token under the distribution it sampled from
    assert llm.settings["logprobs_mode"] == "processed_logprobs" and llm.sampling_params.logprobs == 0

    # dynamic sampling: more rounds than steps, the constant groups (even-indexed prompts) dropped
    assert sum(logged(trainer, "dapo/gen_batches")) > 3 and sum(logged(trainer, "dapo/filtered_groups_all_correct"))
    assert sum(logged(trainer, "dapo/surplus_groups_used")) > 0
    returned = returned_logprobs(llm.sampler)
    for _, batch, _ in batches:
        assert all(prompt_index(tokenizer, prompt) % 2 for prompt, _ in rows_of(batch))
        # the overlong penalty of each completion's length, added to the task reward before the group's advantages
        penalty = soft_overlong_penalty(batch["completion_lengths"], 8, 4)
        torch.testing.assert_close(batch["rewards"][:, 1], penalty)
        total = batch["rewards"].sum(dim=1).view(-1, 4)
        advantages = (total - total.mean(dim=1, keepdim=True)) / (total.std(dim=1, keepdim=True) + 1e-4)
        torch.testing.assert_close(batch["advantages"], advantages.flatten(), atol=1e-5, rtol=1e-4)
        # the old policy: vLLM's logprobs as it returned them, a surplus group's from the step that generated it
        assert_old_policy_is_vllms(batch, returned)
    assert min(float(batch["rewards"][:, 1].min()) for _, batch, _ in batches) < 0
    # the training forward sees vLLM's numerics at the first update: the stand-in's shift, exactly
    assert logged(trainer, "logprob_gap_mean")[0] == pytest.approx(-LOGPROB_SHIFT, abs=1e-5)

    # weights synced before every generation (training and evaluation), and they did move
    generations = llm.sampler.generations
    assert all(generation.gap_to_training == 0 for generation in generations)
    evaluated = [g for g in generations if prompt_index(tokenizer, g.prompts[0]) >= 40]
    trained = [g for g in generations if prompt_index(tokenizer, g.prompts[0]) < 40]
    assert evaluated and all(len(g.prompts) == 16 for g in evaluated) and logged(trainer, "eval_reward")
    assert trained[-1].change_since_loaded > 0 and evaluated[0].change_since_loaded > 0


def test_the_vllm_path_trains_as_a_rollout_func_given_the_same_completions(tiny_model, tmp_path, monkeypatch):
    """The same scripted completions and logprobs (`ScriptedRollout`), once returned by vLLM, once by a
    `rollout_func`: the same groups kept, the same advantages, losses and weights, with dynamic sampling, overlong
    shaping and overlong filtering (`mask_truncated_completions`) on."""
    install(monkeypatch)
    script = ScriptedRollout(AutoTokenizer.from_pretrained(tiny_model))
    settings = dict(
        per_device_train_batch_size=8, learning_rate=0.1, max_steps=2, overlong_buffer_len=4,
        mask_truncated_completions=True, dynamic_sampling_oversample="2.0",
    )  # fmt: skip
    reference = DAPOTrainer(
        model=tiny_model, reward_funcs=even_prompts_constant_else_length, train_dataset=arithmetic_prompts(40),
        args=dapo_args(tmp_path / "rollout_func", **settings), rollout_func=script,
    )  # fmt: skip
    expected = record_batches(reference)
    reference.train()
    trainer = vllm_trainer(tiny_model, tmp_path / "vllm", reward=even_prompts_constant_else_length, **settings)
    trainer.vllm_generation.llm.sampler.script = script.completion
    batches = record_batches(trainer)
    trainer.train()
    assert [step for step, _, _ in batches] == [step for step, _, _ in expected] == [0, 1]
    for (_, batch, _), (_, reference_batch, _) in zip(batches, expected, strict=True):
        assert batch.keys() == reference_batch.keys()
        for key, value in batch.items():
            torch.testing.assert_close(value, reference_batch[key], rtol=0, atol=0, msg=key)
        assert (batch["completion_mask"].sum(dim=1)[batch["truncated"]] == 0).all() and batch["truncated"].any()
    assert sum(logged(trainer, "dapo/filtered_groups")) > 0
    for name in ("loss", "grad_norm", "dapo/gen_batches", "dapo/qualified_groups", "logprob_gap_mean", "reward"):
        assert logged(trainer, name) == logged(reference, name), name
    for (name, value), other in zip(trainer.model.named_parameters(), reference.model.parameters(), strict=True):
        torch.testing.assert_close(value, other, rtol=0, atol=0, msg=name)


def test_recompute_keeps_vllms_logprobs_as_the_rollout_policy_of_the_correction(tiny_model, tmp_path, monkeypatch):
    """`old_logprobs="recompute"`: the old policy is the training model's own logprobs, vLLM's are kept apart as the
    rollout's, and the truncated correction weighs every token by π_old / π_rollout = e^-shift (under the cap 2)."""
    install(monkeypatch)
    trainer = vllm_trainer(
        tiny_model, tmp_path, max_steps=1, dynamic_sampling=False, overlong_buffer_len=0, old_logprobs="recompute",
        rollout_correction="token_truncate",
    )  # fmt: skip
    trainer.train()
    batch = trained_rows(trainer)
    assert_old_policy_is_vllms(
        batch, returned_logprobs(trainer.vllm_generation.llm.sampler), "sampling_per_token_logps"
    )
    mask = batch["completion_mask"].float()
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    old = batch["old_per_token_logps"] * mask
    torch.testing.assert_close(old, teacher_forced_logprobs(model, batch) * mask, atol=1e-5, rtol=1e-5)
    (metrics,) = [h for h in trainer.state.log_history if "loss" in h]
    assert metrics["old_logprob_gap_mean"] == pytest.approx(-LOGPROB_SHIFT, abs=1e-5)
    assert metrics["rollout_correction/weight_mean"] == pytest.approx(math.exp(-LOGPROB_SHIFT), abs=1e-5)
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-5)


def test_server_mode_runs_dapo_through_trls_client(tiny_model, tmp_path, monkeypatch):
    install(monkeypatch, server=VLLMClient.serving(tiny_model))
    with health_endpoint() as url:
        trainer = vllm_trainer(
            tiny_model, tmp_path, vllm_mode="server", vllm_server_base_url=url, overlong_buffer_len=4
        )
    sampler = trainer.vllm_generation.vllm_client.sampler
    sampler.training_model = trainer.model
    batches = record_batches(trainer)
    trainer.train()
    returned = returned_logprobs(sampler)
    for _, batch, _ in batches:
        assert_old_policy_is_vllms(batch, returned)
    assert all(generation.gap_to_training == 0 for generation in sampler.generations)
    assert sampler.generations[-1].change_since_loaded > 0


def test_a_server_whose_logprobs_are_not_the_sampled_distributions_is_refused(tiny_model, tmp_path, monkeypatch):
    install(monkeypatch, server=VLLMClient.serving(tiny_model, logprobs_mode="raw_logprobs"))
    expected = "--logprobs-mode raw_logprobs, .* Restart the server with --logprobs-mode processed_logprobs"
    with health_endpoint() as url, pytest.raises(ValueError, match=expected):
        vllm_trainer(tiny_model, tmp_path, vllm_mode="server", vllm_server_base_url=url)


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        (dict(dynamic_sampling_mode="stream"), "dynamic_sampling_mode='stream'"),
        (dict(partial_rollouts=True), "partial_rollouts=True"),
        (
            dict(rollout_kv_cache_dtype="fp8", old_logprobs="recompute", rollout_correction="token_mask"),
            "rollout_kv_cache_dtype='fp8'",
        ),
    ],
    ids=["stream", "partial_rollouts", "fp8"],
)
def test_what_needs_the_paged_engine_is_refused_with_vllm(tmp_path, settings, named):
    refused = re.escape(f"DAPOConfig.{named} is invalid: it needs trl-dapo's paged engine")
    fix = re.escape("which use_vllm=True does not use: set use_vllm=False and rollout_engine='paged'")
    with pytest.raises(ValueError, match=f"^{refused}.*{fix}"):
        dapo_args(tmp_path, use_vllm=True, **settings)


def test_the_paged_engine_with_vllm_is_refused_before_any_model_loads(tmp_path):
    args = dapo_args(tmp_path, use_vllm=True, rollout_engine="paged")
    expected = "DAPOConfig.rollout_engine='paged' cannot be used here: use_vllm=True: vLLM generates."
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
        check_set_up(args, even_prompts_constant)
