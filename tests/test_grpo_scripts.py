"""A GRPO user's scripts with only `from trl import GRPOConfig, GRPOTrainer` changed to `from trl_dapo import
DAPOConfig, DAPOTrainer`: TRL's own `trl/scripts/grpo.py` (its CLI, PEFT, its reward registry), its docs' multi-task
example, a callback with `log_completions`, and the step DAPOTrainer takes once DAPO's own additions are off, which
must be GRPOTrainer's. Where DAPO differs on purpose the error names the field and the fix (README: Differences from
`GRPOTrainer`).
"""

import json
import re
import runpy
import sys
from pathlib import Path

import pytest
import torch
import trl.scripts.grpo
from datasets import Dataset
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, TrainerCallback
from trl import GRPOConfig, GRPOTrainer
from trl.rewards import get_soft_overlong_punishment

from helpers import CPU_ARGS
from trl_dapo import DAPOConfig, DAPOTrainer
from trl_dapo.integrity import RolloutIntegrityError

PROMPTS = ["The sky is", "The sun is", "Water is", "Fire is"]
SMALL = dict(max_completion_length=8, num_generations=4, per_device_train_batch_size=4, **CPU_ARGS)


def with_dapo_imports(source: str) -> str:
    """`source` with GRPOConfig / GRPOTrainer imported from trl_dapo as DAPOConfig / DAPOTrainer and used so."""
    lines = []
    for line in source.splitlines():
        imported = re.match(r"(\s*)from trl import (.*)", line)
        names = [name.strip() for name in imported.group(2).split(",")] if imported else []
        ours = [name.replace("GRPO", "DAPO") for name in names if name in ("GRPOConfig", "GRPOTrainer")]
        if ours:
            indent, kept = imported.group(1), [name for name in names if name not in ("GRPOConfig", "GRPOTrainer")]
            lines += [f"{indent}from trl import {', '.join(kept)}"] if kept else []
            lines.append(f"{indent}from trl_dapo import {', '.join(ours)}")
        else:
            lines.append(re.sub(r"\bGRPO(Config|Trainer)\b", r"DAPO\1", line))
    return "\n".join(lines) + "\n"


def script_folder(folder: Path) -> Path:
    """TRL's grpo.py with its two imports changed, a reward module it imports by dotted path, a local dataset."""
    source = Path(trl.scripts.grpo.__file__).read_text()
    changed = with_dapo_imports(source)
    assert sum("from trl_dapo import" in line for line in changed.splitlines()) == 2  # the script's two imports
    (folder / "grpo.py").write_text(changed)
    (folder / "script_rewards.py").write_text(
        "def content_length(completions, **kwargs):\n    return [float(len(c[0]['content'])) for c in completions]\n"
    )
    rows = [{"prompt": [{"role": "user", "content": f"What is {i} + {i}?"}]} for i in range(8)]
    (folder / "data").mkdir()
    (folder / "data" / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return folder


def run_script(folder: Path, model: str, *arguments: str, monkeypatch) -> None:
    command = [
        "--model_name_or_path",
        model,
        "--dataset_name",
        str(folder / "data"),
        "--output_dir",
        str(folder / "out"),
    ]
    monkeypatch.chdir(folder)  # the script imports dotted reward functions from the working folder
    monkeypatch.setattr(sys, "path", list(sys.path))  # which it puts on sys.path
    monkeypatch.setattr(sys, "argv", ["grpo.py", *command, *arguments])
    runpy.run_path(str(folder / "grpo.py"), run_name="__main__")


def test_trls_grpo_script_trains_with_peft_and_its_reward_registry_once_its_imports_are_changed(
    tiny_model, tmp_path, monkeypatch
):
    folder = script_folder(tmp_path)
    arguments = [
        "--max_steps", "2", "--max_completion_length", "8", "--learning_rate", "0.1", "--use_cpu", "--bf16", "false",
        "--num_generations", "4", "--per_device_train_batch_size", "4", "--report_to", "none", "--logging_steps", "1",
        "--use_peft", "--lora_target_modules", "q_proj", "v_proj", "--dtype", "float32", "--save_strategy", "no",
        "--reward_funcs", "script_rewards.content_length", "get_soft_overlong_punishment",
    ]  # fmt: skip
    with pytest.raises(ValueError, match=r"penalised twice.*set overlong_buffer_len=0 to keep TRL's"):
        run_script(folder, tiny_model, *arguments, monkeypatch=monkeypatch)
    run_script(folder, tiny_model, *arguments, "--overlong_buffer_len", "0", monkeypatch=monkeypatch)
    adapter = load_file(folder / "out" / "adapter_model.safetensors")
    lora_b = [value for name, value in adapter.items() if "lora_B" in name]
    assert len(lora_b) == 4 and all(value.abs().sum() > 0 for value in lora_b)  # B starts at 0: the adapter trained


@pytest.mark.parametrize("updates", [{}, dict(num_iterations=2, scale_rewards=False)], ids=["one", "two_iterations"])
def test_with_dapos_additions_off_the_update_is_grpotrainers(tiny_model, tmp_path, updates):
    """Dynamic sampling, the overlong penalty and Clip-Higher off, the same script and seed take GRPOTrainer's steps:
    the same completions, advantages and token-mean, the ratio against the sampling policy on the second pass. Plain
    SGD without gradient clipping, so that the parameters differ by the gradients' float error only: Adam's first
    step (about lr x sign(g)) would magnify it where a gradient is near 0, and clipping to a norm would hide a loss
    off by a factor (a token count off by one moves a parameter by 1e-3 here)."""

    def unique_characters(completions, **kwargs):
        return [float(len(set(completion))) for completion in completions]

    settings = dict(
        SMALL, per_device_train_batch_size=8, max_steps=updates.get("num_iterations", 1), optim="sgd", seed=3
    )
    settings.update(learning_rate=1.0, max_grad_norm=0.0, **updates)
    models = []
    for trainer_class, config_class, own in (
        (GRPOTrainer, GRPOConfig, {}),
        (DAPOTrainer, DAPOConfig, dict(dynamic_sampling=False, overlong_buffer_len=0, epsilon_high=0.2)),
    ):
        trainer = trainer_class(
            model=tiny_model,
            reward_funcs=unique_characters,
            args=config_class(output_dir=str(tmp_path / trainer_class.__name__), **settings, **own),
            train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        )
        trainer.train()
        models.append(trainer.model)
    start = AutoModelForCausalLM.from_pretrained(tiny_model)
    for (name, grpo), dapo, initial in zip(
        models[0].named_parameters(), models[1].parameters(), start.parameters(), strict=True
    ):
        assert not torch.equal(grpo, initial), name
        torch.testing.assert_close(dapo, grpo, rtol=0, atol=1e-5, msg=name)


def test_trls_soft_overlong_punishment_beside_dapos_own_is_refused_before_the_model_loads(tmp_path):
    def task(completions, **kwargs):
        return [0.0] * len(completions)

    args = DAPOConfig(output_dir=str(tmp_path), **SMALL)
    with pytest.raises(ValueError, match=r"soft_overlong_punishment_reward.*overlong_buffer_len=1;"):
        DAPOTrainer(
            model=str(tmp_path / "no-model-here"),
            reward_funcs=[task, get_soft_overlong_punishment(max_completion_len=8, soft_punish_cache=2)],
            args=args,
            train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        )


def test_the_docs_multi_task_example_names_the_completions_no_function_scores_and_the_fix(tiny_model, tmp_path):
    """TRL's docs (multi-task reward functions) score code rows with `t == "coding"` while the rows say "code": no
    function scores them. GRPOTrainer trains them with zero advantage; DAPOTrainer stops, naming the way out."""
    tasks = ["math", "code", "math", "code"]

    def math_reward_func(completions, task, **kwargs):
        return [float(len(c)) if t == "math" else None for c, t in zip(completions, task, strict=True)]

    def coding_reward_func(completions, task, **kwargs):
        return [float(len(set(c))) if t == "coding" else None for c, t in zip(completions, task, strict=True)]

    trainer = DAPOTrainer(
        model=tiny_model,
        reward_funcs=[math_reward_func, coding_reward_func],
        args=DAPOConfig(
            output_dir=str(tmp_path),
            **dict(SMALL, per_device_train_batch_size=16),
            max_steps=1,
            dynamic_sampling_metric="reward",  # one function per task: the task's score is the total
        ),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS, "task": tasks}),
    )
    unscored = r"\['math_reward_func', 'coding_reward_func'\] returned None/NaN"
    with pytest.raises(RolloutIntegrityError, match=rf"{unscored}.*return a number for it.*or drop its prompt"):
        trainer.train()


class LoggedSteps(TrainerCallback):
    def __init__(self) -> None:
        self.logs: list[dict] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs))


def test_a_callback_sees_each_steps_loss_and_reward_and_save_model_writes_the_trained_weights(tiny_model, tmp_path):
    def text_length(completions, **kwargs):
        return [float(len(completion)) for completion in completions]

    callback = LoggedSteps()
    trainer = DAPOTrainer(
        model=tiny_model,
        reward_funcs=text_length,
        args=DAPOConfig(output_dir=str(tmp_path), **SMALL, max_steps=2, learning_rate=0.1, log_completions=True),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        callbacks=[callback],
    )
    trainer.train()
    steps = [logs for logs in callback.logs if "loss" in logs]
    assert len(steps) == 2 and all({"reward", "rewards/text_length/mean", "entropy"} <= set(logs) for logs in steps)
    trainer.save_model(str(tmp_path / "final"))
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    start = AutoModelForCausalLM.from_pretrained(tiny_model)
    for (name, value), trained, initial in zip(
        saved.named_parameters(), trainer.model.parameters(), start.parameters(), strict=True
    ):
        assert torch.equal(value, trained) and not torch.equal(value, initial), name


@pytest.mark.parametrize(
    ("field", "value"), [("scale_rewards", "batch"), ("multi_objective_aggregation", "normalize_then_sum")]
)
def test_a_grpo_setting_dynamic_sampling_refuses_names_the_way_back_to_grpos_sampling(tmp_path, field, value):
    with pytest.raises(ValueError, match=rf"DAPOConfig.{field}='{value}' is invalid.* or dynamic_sampling=False\."):
        DAPOConfig(output_dir=str(tmp_path), **SMALL, **{field: value})
    assert (
        getattr(DAPOConfig(output_dir=str(tmp_path), **SMALL, dynamic_sampling=False, **{field: value}), field)
        == value
    )
