"""Optimizer steps that must not move the weights: a step with rows but no loss token (every completion masked), and
a step whose loss or gradient is not finite. Each leaves the parameters and AdamW's state as they were, is counted,
and is said in a warning; no checkpoint ever holds non-finite weights."""

import logging

import torch
from accelerate import Accelerator
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerState

from helpers import Snapshots, arithmetic_prompts, dapo_args, length_reward
from trl_dapo import DAPOTrainer
from trl_dapo.testing import ScriptedRollout
from trl_dapo.trainer.safety.finite_steps import FiniteSteps


class NeverEnds(ScriptedRollout):
    """The scripted rollout's completions without their EOS: every one is truncated."""

    def completion(self, prompt_ids: list[int], index: int) -> tuple[list[int], list[float]]:
        ids, logps = super().completion(prompt_ids, index)
        if ids[-1] == self.tokenizer.eos_token_id:
            return ids[:-1], logps[:-1]
        return ids, logps


def adamw_trainer(tiny_model, rollout, output_dir, **overrides) -> DAPOTrainer:
    """8 rows a step, AdamW with weight decay (which moves weights even where the gradient is 0), scripted rollouts."""
    args = dapo_args(
        output_dir,
        per_device_train_batch_size=8,
        optim="adamw_torch",
        learning_rate=1e-3,
        weight_decay=0.1,
        **overrides,
    )
    return DAPOTrainer(
        model=tiny_model,
        reward_funcs=length_reward,
        args=args,
        train_dataset=arithmetic_prompts(40),
        rollout_func=rollout(AutoTokenizer.from_pretrained(tiny_model)),
    )


def logged(trainer, name):
    return [h[name] for h in trainer.state.log_history if name in h]


def test_a_step_without_a_loss_token_leaves_the_weights_alone(tiny_model, tmp_path, caplog):
    """mask_truncated_completions=True and every completion truncated: the step's loss and gradient are 0, but
    AdamW's weight decay would still move every weight. The step is skipped as a step without rows is."""
    trainer = adamw_trainer(
        tiny_model,
        NeverEnds,
        tmp_path,
        max_steps=1,
        mask_truncated_completions=True,
        dynamic_sampling=False,  # which drops such groups as uninformative
    )
    with caplog.at_level(logging.WARNING, logger="trl_dapo"):
        trainer.train()
    initial = AutoModelForCausalLM.from_pretrained(tiny_model).state_dict()
    for name, parameter in trainer.model.named_parameters():
        assert torch.equal(parameter.detach(), initial[name]), name
    assert not trainer.optimizer.state  # AdamW never stepped: no moments
    assert logged(trainer, "dapo/skipped_steps") == [1.0]
    assert "1 of the 1 optimizer steps of this generation batch have rows but no loss token" in caplog.text


def test_a_step_with_a_non_finite_gradient_is_skipped_and_never_saved(tiny_model, tmp_path, caplog):
    """A NaN in one parameter's gradient at step 2 (a hook on it): before the fix the optimizer stepped, every weight
    of that matrix became NaN and checkpoint-2 saved them. Now step 2 leaves weights and moments as step 1 left them,
    step 3 trains, the count is logged and checkpoint-2 holds step 1's (finite) weights."""
    trainer = adamw_trainer(
        tiny_model, ScriptedRollout, tmp_path, max_steps=3, dynamic_sampling=False, save_strategy="steps", save_steps=1
    )
    name, poisoned = next(iter(trainer.model.named_parameters()))
    poisoned.register_hook(lambda grad: grad * float("nan") if trainer.state.global_step == 1 else grad)
    snapshots = Snapshots()
    trainer.add_callback(snapshots)
    with caplog.at_level(logging.WARNING, logger="trl_dapo"):
        trainer.train()
    (first, first_moments), (second, second_moments), (third, _) = snapshots.steps
    assert all(torch.equal(second[n], value) for n, value in first.items())
    assert first_moments and all(torch.equal(second_moments[k], value) for k, value in first_moments.items())
    assert not torch.equal(third[name], second[name]) and all(value.isfinite().all() for value in third.values())
    saved = load_file(tmp_path / "checkpoint-2" / "model.safetensors")
    assert all(torch.equal(saved[n], value) for n, value in first.items() if n in saved)
    assert logged(trainer, "dapo/nonfinite_steps") == [0.0, 1.0, 1.0]
    assert "Optimizer step 2: the gradient is not finite; the step is skipped" in caplog.text


def test_a_step_with_a_non_finite_loss_is_skipped_even_with_finite_gradients():
    """A loss that is NaN while its gradient is finite (a NaN term that no parameter reaches): the step is skipped
    as a non-finite gradient's is, so AdamW's weight decay does not move the weights either."""
    accelerator = Accelerator(cpu=True)
    layer = torch.nn.Linear(3, 2)
    before = [p.detach().clone() for p in layer.parameters()]
    optimizer = torch.optim.AdamW(layer.parameters(), lr=0.1, weight_decay=0.1)
    guard = FiniteSteps(accelerator, fp16=False)
    loss = layer(torch.ones(1, 3)).sum() + torch.tensor(float("nan"))
    guard.record_loss(loss, ends_step=True, step=1)
    loss.backward()
    assert all(p.grad.isfinite().all() for p in layer.parameters())
    guard.on_pre_optimizer_step(None, TrainerState(), None, optimizer=optimizer)
    optimizer.step()
    assert all(torch.equal(p, b) for p, b in zip(layer.parameters(), before, strict=True))
    assert not optimizer.state and guard.skipped_steps == 1
