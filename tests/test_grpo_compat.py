"""A GRPO user's scenarios run through DAPOTrainer with DAPOConfig's defaults (16 samples per prompt, dynamic
sampling on): reward models, several reward functions with weights and None outputs, standard and conversational
prompts, PEFT, evaluation, a streaming dataset, a mixture-of-experts model's router loss, generation settings and
resume. Each must train: the loss is logged and the trainable parameters move.

Only what keeps the tests small is set (a short completion, one or two steps, a log line per step), with the
learning rate TRL's own tests use (the tiny model's gradients are small). The hook signatures DAPOTrainer overrides
are pinned against the installed TRL, so an upgrade that changes one fails here first.
"""

import inspect

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM, TrainerCallback
from trl import GRPOConfig, GRPOTrainer
from trl.chat_template_utils import qwen2_5_chat_template

from trl_dapo import DAPOConfig, DAPOTrainer
from trl_dapo.tiny_model import build_tiny_model, build_tiny_tokenizer
from trl_dapo.trainer.training.micro_batches import MicroBatch
from trl_dapo.trainer.training.step_metrics import StepMetrics

PROMPTS = ["Beautiful is better than", "Explicit is", "Simple is better", "Complex", "Flat is better than", "Sparse"]


def standard_prompts() -> Dataset:
    return Dataset.from_dict({"prompt": PROMPTS})


def conversational_prompts() -> Dataset:
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": text}] for text in PROMPTS]})


def compat_args(output_dir, **overrides) -> DAPOConfig:
    settings = dict(
        output_dir=str(output_dir),
        learning_rate=0.1,
        max_completion_length=8,
        max_steps=1,
        report_to="none",
        logging_steps=1,
    )
    return DAPOConfig(**{**settings, **overrides})


def text_length(completions, **kwargs) -> list[float]:
    return [float(len(completion)) for completion in completions]


def unique_characters(completions, **kwargs) -> list[float]:
    return [float(len(set(completion))) for completion in completions]


def train_and_check(trainer: DAPOTrainer) -> DAPOTrainer:
    """Train; the loss must be logged and every trainable parameter must move (frozen ones must not)."""
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    trainable = {name for name, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    assert trainer.state.log_history[-1]["train_loss"] is not None
    assert trainer.state.global_step == trainer.args.max_steps
    for name, value in trainer.model.named_parameters():
        moved = not torch.equal(before[name], value)
        assert moved == (name in trainable), f"{name}: moved={moved}, trainable={name in trainable}"
    return trainer


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory) -> str:
    return build_tiny_model(tmp_path_factory.mktemp("reward-model"), kind="reward", seed=1)


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory) -> str:
    return build_tiny_model(tmp_path_factory.mktemp("moe-model"), kind="moe")


def test_a_bare_trainer_builds_with_its_default_config(tiny_model, reward_model, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default output_dir is relative
    trainer = DAPOTrainer(model=tiny_model, reward_funcs=reward_model, train_dataset=standard_prompts())
    assert (trainer.args.num_generations, trainer.args.generation_batch_size) == (16, 16)


@pytest.mark.parametrize("dataset", [standard_prompts, conversational_prompts], ids=["standard", "conversational"])
def test_reward_model(tiny_model, reward_model, tmp_path, dataset):
    train_and_check(
        DAPOTrainer(model=tiny_model, reward_funcs=reward_model, args=compat_args(tmp_path), train_dataset=dataset())
    )


def test_conversational_reward_function(tiny_model, tmp_path):
    def content_length(completions, **kwargs):
        return [float(len(completion[0]["content"])) for completion in completions]

    train_and_check(
        DAPOTrainer(
            model=tiny_model,
            reward_funcs=content_length,
            args=compat_args(tmp_path),
            train_dataset=conversational_prompts(),
        )
    )


def test_several_weighted_reward_functions_with_none_outputs_and_an_async_one(tiny_model, tmp_path):
    def not_applicable(completions, **kwargs):
        return [None] * len(completions)

    async def async_unique_characters(completions, **kwargs):
        return unique_characters(completions)

    trainer = train_and_check(
        DAPOTrainer(
            model=tiny_model,
            reward_funcs=[text_length, not_applicable, async_unique_characters],
            args=compat_args(tmp_path, reward_weights=[0.7, 1.0, 0.3], dynamic_sampling_metric="text_length"),
            train_dataset=standard_prompts(),
        )
    )
    logs = trainer.state.log_history[0]
    assert logs["rewards/text_length/mean"] > 0 and logs["rewards/async_unique_characters/std"] >= 0
    assert logs["rewards/not_applicable/mean"] is None  # all NaN, as TRL logs it


def test_reward_function_reading_a_dataset_column_and_the_trainer_state(tiny_model, tmp_path):
    seen_steps = []

    def closer_to_target(completions, target, trainer_state, **kwargs):
        seen_steps.append(trainer_state.global_step)
        return [-abs(len(completion) - t) for completion, t in zip(completions, target, strict=True)]

    dataset = standard_prompts().add_column("target", list(range(len(PROMPTS))))
    train_and_check(
        DAPOTrainer(model=tiny_model, reward_funcs=closer_to_target, args=compat_args(tmp_path), train_dataset=dataset)
    )
    assert seen_steps and set(seen_steps) == {0}


def test_peft(tiny_model, tmp_path):
    train_and_check(  # two steps: LoRA's B starts at zero, so A only gets a gradient from the second step on
        DAPOTrainer(
            model=AutoModelForCausalLM.from_pretrained(tiny_model),
            reward_funcs=text_length,
            args=compat_args(tmp_path, max_steps=2),
            train_dataset=standard_prompts(),
            peft_config=LoraConfig(target_modules=["q_proj", "v_proj"]),
        )
    )


def test_evaluation(tiny_model, tmp_path):
    trainer = train_and_check(
        DAPOTrainer(
            model=tiny_model,
            reward_funcs=text_length,
            args=compat_args(tmp_path, eval_strategy="steps", eval_steps=1),
            train_dataset=standard_prompts(),
            eval_dataset=Dataset.from_dict({"prompt": PROMPTS[:2]}),
        )
    )
    assert any("eval_loss" in h for h in trainer.state.log_history)


def test_streaming_dataset(tiny_model, tmp_path):
    trainer = train_and_check(
        DAPOTrainer(
            model=tiny_model,
            reward_funcs=text_length,
            args=compat_args(tmp_path, max_steps=2),
            train_dataset=standard_prompts().to_iterable_dataset(),
        )
    )
    assert trainer.state.global_step == 2


def test_generation_settings(tiny_model, tmp_path):
    train_and_check(
        DAPOTrainer(
            model=tiny_model,
            reward_funcs=text_length,
            args=compat_args(
                tmp_path,
                top_p=0.9,
                top_k=10,
                min_p=0.01,
                repetition_penalty=1.1,
                generation_kwargs={"do_sample": True},
            ),
            train_dataset=standard_prompts(),
        )
    )


def test_mixture_of_experts_trains_and_logs_trls_aux_loss(moe_model, tmp_path):
    trainer = train_and_check(
        DAPOTrainer(
            model=moe_model, reward_funcs=text_length, args=compat_args(tmp_path), train_dataset=standard_prompts()
        )
    )
    assert trainer.aux_loss_enabled and trainer.state.log_history[0]["aux_loss"] > 0


def test_mixture_of_experts_aux_loss_is_scaled_as_trl_scales_it(moe_model, tmp_path):
    """With zero advantages both policy losses are 0, so each trainer's loss is its router term alone: DAPO's must
    be TRL's, coef x aux / gradient accumulation steps (for DAPO: the optimizer step's passes, here one per
    micro-batch), with the same logged aux_loss."""
    generator = torch.Generator().manual_seed(0)
    completion_ids = torch.randint(3, 300, (4, 5), generator=generator)
    inputs = {
        "prompt_ids": torch.randint(3, 300, (4, 3), generator=generator),
        "prompt_mask": torch.ones(4, 3, dtype=torch.long),
        "completion_ids": completion_ids,
        "completion_mask": torch.ones_like(completion_ids),
        "advantages": torch.zeros(4),
        "old_per_token_logps": torch.full((4, 5), -6.0),
        "num_items_in_batch": torch.tensor(20.0),  # TRL's key
    }
    settings = dict(max_completion_length=8, report_to="none", use_cpu=True, bf16=False, num_generations=4)
    losses, aux = {}, {}
    for kind, trainer_class, config_class in (("dapo", DAPOTrainer, DAPOConfig), ("trl", GRPOTrainer, GRPOConfig)):
        trainer = trainer_class(
            model=moe_model,
            reward_funcs=text_length,
            args=config_class(output_dir=str(tmp_path / kind), per_device_train_batch_size=4, **settings),
            train_dataset=standard_prompts(),
        )
        trainer.model.train()
        if kind == "dapo":  # an optimizer step of two micro-batches, one pass each, the same rows
            metrics = StepMetrics()
            step = [
                MicroBatch([dict(inputs)], [False], torch.tensor(40.0), 2, metrics, last) for last in (False, True)
            ]
            losses[kind] = [trainer._compute_loss(trainer.model, micro_batch).item() for micro_batch in step][-1]
        else:
            trainer.current_gradient_accumulation_steps = 2
            losses[kind] = trainer._compute_loss(trainer.model, inputs).item()
        aux[kind] = trainer._metrics["train"]["aux_loss"][-1]
    model = AutoModelForCausalLM.from_pretrained(moe_model)
    input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)
    expected = model(input_ids=input_ids, output_router_logits=True).aux_loss.item()
    assert aux["dapo"] == pytest.approx(aux["trl"], rel=1e-6) and aux["dapo"] == pytest.approx(expected, rel=1e-5)
    assert losses["dapo"] == pytest.approx(losses["trl"], rel=1e-6)
    assert losses["dapo"] == pytest.approx(0.01 * expected / 2, rel=1e-5)


class StepCounter(TrainerCallback):
    def __init__(self) -> None:
        self.steps = 0

    def on_step_end(self, args, state, control, **kwargs):
        self.steps += 1


def test_resume_continues_where_the_checkpoint_left_off(tiny_model, tmp_path):
    def trainer(folder):
        return DAPOTrainer(
            model=tiny_model,
            reward_funcs=text_length,
            args=compat_args(tmp_path / folder, max_steps=2, save_strategy="steps", save_steps=1),
            train_dataset=standard_prompts(),
        )

    straight = trainer("straight")
    straight.train()
    resumed, counter = trainer("resumed"), StepCounter()
    resumed.add_callback(counter)
    resumed.train(resume_from_checkpoint=str(tmp_path / "straight" / "checkpoint-1"))
    assert counter.steps == 1 and resumed.state.global_step == 2  # only step 2 ran again
    losses = [[h["loss"] for h in t.state.log_history if "loss" in h] for t in (straight, resumed)]
    assert losses[0] == losses[1]
    for (name, a), b in zip(straight.model.named_parameters(), resumed.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, msg=name)


def plain_signature(function) -> str:
    parameters = inspect.signature(function).parameters.values()
    return ", ".join(p.name if p.default is p.empty else f"{p.name}={p.default!r}" for p in parameters)


# The TRL methods DAPOTrainer overrides or calls, as they read in TRL 1.16.
PINNED_SIGNATURES = {
    "__init__": "self, model, reward_funcs=None, args=None, train_dataset=None, eval_dataset=None, "
    "processing_class=None, reward_processing_classes=None, callbacks=None, optimizers=(None, None), "
    "quantization_config=None, peft_config=None, tools=None, rollout_func=None, environment_factory=None",
    "_generate_single_turn": "self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False",
    "_calculate_rewards": "self, inputs, prompts, completions, completion_ids_list",
    "_tokenize_prompts": "self, prompts",
    "_generate_and_score_completions": "self, inputs",
    "_prepare_inputs": "self, generation_batch",
    "_compute_loss": "self, model, inputs",
    "_get_train_sampler": "self, dataset=None",
    "get_resumed_dataloader": "self, dataloader, num_batches",
    "_save_checkpoint": "self, model, trial",
    "_load_optimizer_and_scheduler": "self, checkpoint",
    "_load_from_checkpoint": "self, resume_from_checkpoint, model=None",
    "_issue_warnings_after_load": "self, load_result",
    "_run_epoch": "self, model, epoch, train_dataloader, steps_in_epoch, num_update_steps_per_epoch, trial, "
    "ignore_keys_for_eval, start_time, resume_from_checkpoint, epochs_trained, steps_trained_in_current_epoch",
    "log": "self, logs, start_time=None",
    "train": "self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None",
    "evaluation_loop": "self, dataloader, description, prediction_loss_only=None, ignore_keys=None, "
    "metric_key_prefix='eval'",
    "_get_per_token_logps_and_entropies": "self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, "
    "compute_entropy=False, compute_aux_loss=False, pixel_values=None, image_grid_thw=None, num_images=None, "
    "pixel_attention_mask=None, spatial_shapes=None, num_tiles=None, image_sizes=None, token_type_ids=None, "
    "mm_token_type_ids=None, image_position_ids=None",
}


def test_the_trl_hooks_dapo_relies_on_keep_their_signatures():
    overridden = {
        name for name, member in vars(DAPOTrainer).items() if callable(member) and hasattr(GRPOTrainer, name)
    }
    assert overridden <= set(PINNED_SIGNATURES), f"pin the signature of {overridden - set(PINNED_SIGNATURES)}"
    for name, expected in PINNED_SIGNATURES.items():
        assert plain_signature(getattr(GRPOTrainer, name)) == expected, f"GRPOTrainer.{name} changed"


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


TOOL_CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call><|im_end|>'


def tool_calling_model(folder) -> str:
    """The tiny model with a chat template TRL knows how to parse tool calls from (Qwen2.5's)."""
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = qwen2_5_chat_template
    return build_tiny_model(folder, tokenizer=tokenizer)


def call_the_tool_then_answer(trainer):
    """The model's `generate`, scripted: a random tiny model never writes a tool call, so each prompt's first turn
    calls `add` and the turn after the tool's result answers. TRL's own tool loop runs between the two."""
    tokenizer = trainer.processing_class

    def generate(input_ids, attention_mask=None, **kwargs):
        replies = [
            tokenizer("3<|im_end|>" if "<tool_response>" in tokenizer.decode(ids) else TOOL_CALL)["input_ids"]
            for ids in input_ids.tolist()
        ]
        width = max(map(len, replies))
        padded = [reply + [tokenizer.pad_token_id] * (width - len(reply)) for reply in replies]
        return torch.cat([input_ids, torch.tensor(padded, device=input_ids.device)], dim=1)

    return generate


def recording(trainer_class: type[GRPOTrainer], calls: list[str]) -> type[GRPOTrainer]:
    class Recording(trainer_class):
        def _generate_single_turn(self, *args, **kwargs):
            calls.append("generate")
            return super()._generate_single_turn(*args, **kwargs)

        def _calculate_rewards(self, *args, **kwargs):
            calls.append("score")
            return super()._calculate_rewards(*args, **kwargs)

    return Recording


@pytest.mark.parametrize("tools", [False, True], ids=["plain", "tool-call"])
def test_trls_round_generates_then_scores_once(tmp_path, tools):
    """What DAPOTrainer's round context relies on in TRL 1.16 (`trainer/collection/round.py`): one call of
    `_generate_and_score_completions` calls `_generate_single_turn` once, again for each tool-calling turn, then
    `_calculate_rewards` once. Recorded on TRL's own trainer."""
    calls = []
    settings = dict(report_to="none", use_cpu=True, bf16=False, num_generations=4)
    args = GRPOConfig(
        output_dir=str(tmp_path / "run"), per_device_train_batch_size=4, max_steps=1,
        max_completion_length=160 if tools else 4, **settings,
    )  # fmt: skip
    trainer = recording(GRPOTrainer, calls)(
        model=tool_calling_model(tmp_path / "model") if tools else build_tiny_model(tmp_path / "model"),
        reward_funcs=text_length,
        args=args,
        train_dataset=conversational_prompts() if tools else standard_prompts(),
        tools=[add] if tools else None,
    )
    if tools:
        trainer.model.generate = call_the_tool_then_answer(trainer)
    trainer.train()
    assert calls == (["generate", "generate", "score"] if tools else ["generate", "score"])
    if tools:
        assert trainer.state.log_history[0]["tools/call_frequency"] == 1.0


def alternating_rows(completions, **kwargs) -> list[float]:
    """0, 1, 0, 1 down the rows: every group varies, whatever the (scripted, identical) completions."""
    return [float(row % 2) for row in range(len(completions))]


def test_a_round_with_a_tool_call_trains(tmp_path):
    """With tools, TRL's loop generates once per turn within one round: DAPOTrainer trains on the whole conversation,
    the tool's result outside the loss."""
    calls = []
    trainer = recording(DAPOTrainer, calls)(
        model=tool_calling_model(tmp_path / "model"),
        reward_funcs=alternating_rows,
        args=compat_args(tmp_path / "run", max_completion_length=160, num_generations=4, per_device_train_batch_size=4,
                         dynamic_sampling=False, use_cpu=True, bf16=False),
        train_dataset=conversational_prompts(),
        tools=[add],
    )  # fmt: skip
    trainer.model.generate = call_the_tool_then_answer(trainer)
    train_and_check(trainer)
    assert calls == ["generate", "generate", "score"]
    (metrics,) = [h for h in trainer.state.log_history if "loss" in h]
    assert metrics["tools/call_frequency"] == 1.0
    # the model wrote the call and the answer; the tool's result is not its tokens
    answer = len(trainer.processing_class("3<|im_end|>")["input_ids"])
    assert metrics["completions/mean_length"] == len(trainer.processing_class(TOOL_CALL)["input_ids"]) + answer
