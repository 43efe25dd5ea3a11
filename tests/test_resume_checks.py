"""Resuming never drops state silently, and names what it cannot use: a checkpoint without the optimizer, scheduler or
RNG state resumes with a warning naming each state that starts fresh; weights lacking a tensor, a negative step and a
damaged file are errors naming the file, the field and the way on, never torch's or safetensors' bare exception; a
correct resume logs no missing key (tied embeddings) and a run prints no deprecation warning for activation
checkpointing."""

import json
import logging
import os
import shutil
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_checkpoint_safety import make_trainer, steps_logged

from helpers import arithmetic_prompts, dapo_args, length_reward
from trl_dapo import DAPOTrainer
from trl_dapo.trainer.safety.checkpoint_files import SAMPLING_STATE_FILE
from trl_dapo.trainer.safety.checkpoint_manifest import write_manifest
from trl_dapo.trainer.safety.resume_checks import check_trainer_files, trainer_files

# a checkpoint inside a generation batch (4 micro-batches a batch, 2 a step) holds every file a resume reads
INSIDE_A_BATCH = dict(gradient_accumulation_steps=2, steps_per_generation=4)


@pytest.fixture(scope="module")
def saved(tiny_model, tmp_path_factory):
    """A 1-step run's output folder, its checkpoint-1 saved inside a generation batch: each test damages a copy."""
    folder = tmp_path_factory.mktemp("saved")
    make_trainer(tiny_model, folder, max_steps=1, **INSIDE_A_BATCH).train()
    assert (folder / "checkpoint-1" / "dapo_generation_batch_0.pt").exists()
    return folder


@pytest.fixture
def checkpoint(saved, tmp_path):
    shutil.copytree(saved, tmp_path / "run")
    return tmp_path / "run" / "checkpoint-1"


def resume(tiny_model, checkpoint, **overrides):
    """A run of 2 steps resumed from `checkpoint` (by its path), its output beside it: the trainer."""
    trainer = make_trainer(tiny_model, checkpoint.parent, max_steps=2, **{**INSIDE_A_BATCH, **overrides})
    trainer.train(resume_from_checkpoint=str(checkpoint))
    return trainer


def edited(checkpoint, name, edit):
    """`edit` applied to the state `name` holds (as torch.save wrote it), saved back, and the manifest written anew:
    the file is as its save wrote it as far as the manifest can tell."""
    path = checkpoint / name
    state = torch.load(path, weights_only=False)
    edit(state)
    torch.save(state, path)
    write_manifest(checkpoint)


def without(field):
    return lambda state: state.pop(field)


def truncated(checkpoint, name, size):
    os.truncate(checkpoint / name, size)
    write_manifest(checkpoint)


class Foreign:
    """Not a tensor nor a plain value: torch.load(weights_only=True) refuses it, and loading it otherwise runs code."""


DAMAGES = {
    # the field a load reads, gone: a KeyError naming neither file nor checkpoint before
    "optimizer.pt without param_groups": (
        lambda c: edited(c, "optimizer.pt", without("param_groups")),
        "optimizer.pt",
        "lacks the field 'param_groups'",
    ),
    "scheduler.pt without lr_lambdas": (
        lambda c: edited(c, "scheduler.pt", without("lr_lambdas")),
        "scheduler.pt",
        "lacks the field 'lr_lambdas'",
    ),
    "rng_state.pth without python": (
        lambda c: edited(c, "rng_state.pth", without("python")),
        "rng_state.pth",
        "lacks the field 'python'",
    ),
    "sampling state without buffer": (
        lambda c: edited(c, SAMPLING_STATE_FILE, without("buffer")),
        SAMPLING_STATE_FILE,
        "lacks the field 'buffer'",
    ),
    "sampling state's buffer without surplus_birth": (
        lambda c: edited(c, SAMPLING_STATE_FILE, lambda s: s["buffer"].pop("surplus_birth")),
        SAMPLING_STATE_FILE,
        "lacks the field 'surplus_birth'",
    ),
    "generation batch without processes": (
        lambda c: edited(c, "dapo_generation_batch_0.pt", without("processes")),
        "dapo_generation_batch_0.pt",
        "lacks the field 'processes'",
    ),
    # torch's own errors: "PytorchStreamReader failed reading zip archive", "OSError: [Errno 22] Invalid argument"
    "optimizer.pt cut short": (
        lambda c: truncated(c, "optimizer.pt", 100),
        "optimizer.pt",
        "cannot be read (RuntimeError: PytorchStreamReader failed reading zip archive",
    ),
    "rng_state.pth cut in half": (
        lambda c: truncated(c, "rng_state.pth", 7000),
        "rng_state.pth",
        "cannot be read (OSError: [Errno 22] Invalid argument)",
    ),
    # "Weights only load failed", which advises weights_only=False
    "optimizer.pt holding a foreign object": (
        lambda c: edited(c, "optimizer.pt", lambda s: s.update(extra=Foreign())),
        "optimizer.pt",
        "cannot be read (it holds a test_resume_checks.Foreign, not only tensors and plain values; loading it "
        "would run code)",
    ),
    # safetensors' "Error while deserializing header: incomplete metadata, file not fully covered"
    "weights cut in half": (
        lambda c: truncated(c, "model.safetensors", (c / "model.safetensors").stat().st_size // 2),
        "model.safetensors",
        "cannot be read (SafetensorError: Error while deserializing header: incomplete metadata",
    ),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_checkpoint_file_is_named_with_its_field_and_the_way_on(tiny_model, checkpoint, damage):
    """Each raised a bare exception (the KeyError's field alone, torch's or safetensors' message, torch's advice to
    load with weights_only=False) naming neither the file nor the checkpoint. The manifest is written anew after
    each damage: one saved before manifests, or a file damaged in place above the checksum limit, gets this far."""
    damaged, name, what = DAMAGES[damage]
    damaged(checkpoint)
    with pytest.raises(RuntimeError) as raised:
        resume(tiny_model, checkpoint)
    message = str(raised.value)
    assert message.startswith(f"{name} of resume_from_checkpoint={str(checkpoint)!r} {what}")
    assert "resume from an earlier checkpoint" in message.lower()  # the way on
    assert "weights_only" not in message  # torch's advice, which would run code from the file
    assert raised.value.__context__ is None or raised.value.__suppress_context__  # nor its traceback shown


@pytest.mark.parametrize(
    "lacks",
    [("optimizer.pt",), ("scheduler.pt",), ("rng_state.pth",), ("optimizer.pt", "scheduler.pt", "rng_state.pth")],
    ids=["optimizer", "scheduler", "rng", "all three"],
)
def test_a_checkpoint_without_a_trainer_state_resumes_with_a_warning_naming_what_starts_fresh(
    tiny_model, checkpoint, caplog, lacks
):
    """A manifest written after deleting these (as a save with save_only_model=True leaves them out): the run
    resumed with that state fresh and said nothing."""
    for name in lacks:
        (checkpoint / name).unlink()
    write_manifest(checkpoint)
    with caplog.at_level(logging.WARNING, logger="trl_dapo"):
        trainer = resume(tiny_model, checkpoint)
    assert trainer.state.global_step == 2
    fresh = {
        "optimizer.pt": "the optimizer's state (AdamW's moments, for one)",
        "scheduler.pt": "the learning-rate schedule (from its first step, warmup included)",
        "rng_state.pth": "the random state (sampling draws other numbers than the saved run would)",
    }
    assert (
        f"resume_from_checkpoint={str(checkpoint)!r} holds no {', '.join(lacks)} (saved with save_only_model=True, "
        "or deleted since): the weights, the step and DAPO's sampling state are restored, but these start fresh: "
        f"{'; '.join(fresh[name] for name in lacks)}. The run does not go on as the one that saved it would have."
    ) in caplog.text


def test_a_run_saving_weights_only_resumes_with_the_warning(tiny_model, tmp_path, caplog):
    """save_only_model=True: its checkpoints hold no optimizer, scheduler or RNG state, and a resumed run trained on
    with fresh ones, silently."""
    make_trainer(tiny_model, tmp_path, max_steps=1, save_only_model=True).train()
    assert not (tmp_path / "checkpoint-1" / "optimizer.pt").exists()
    resumed = make_trainer(tiny_model, tmp_path, max_steps=2, save_only_model=True)
    with caplog.at_level(logging.WARNING, logger="trl_dapo"):
        resumed.train(resume_from_checkpoint=True)
    assert steps_logged(resumed) == [1, 2]
    assert "holds no optimizer.pt, scheduler.pt, rng_state.pth (saved with save_only_model=True" in caplog.text


def test_on_several_processes_each_ones_rng_state_is_checked(checkpoint):
    """Saved on 2 processes, a checkpoint holds rng_state_0.pth and rng_state_1.pth (the Trainer reads its own
    process's, saying nothing where it is absent): here rank 1's is absent, and rank 0's cut short."""
    (checkpoint / "rng_state.pth").rename(checkpoint / "rng_state_0.pth")
    parameter = torch.zeros(1, requires_grad=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD([parameter], lr=1.0), lambda step: 1.0)
    files = trainer_files(sharded=False, scheduler=scheduler, world_size=2)
    assert files == {
        "optimizer.pt": ("state", "param_groups"),
        "scheduler.pt": ("last_epoch", "base_lrs", "lr_lambdas"),
        "rng_state_0.pth": ("python", "numpy", "cpu"),
        "rng_state_1.pth": ("python", "numpy", "cpu"),
    }
    assert check_trainer_files(str(checkpoint), files).startswith(
        f"resume_from_checkpoint={str(checkpoint)!r} holds no rng_state_1.pth (saved with save_only_model=True, "
    )
    os.truncate(checkpoint / "rng_state_0.pth", 100)
    with pytest.raises(RuntimeError, match=r"^rng_state_0.pth of resume_from_checkpoint=.* cannot be read \("):
        check_trainer_files(str(checkpoint), files)
    assert trainer_files(sharded=True, scheduler=scheduler, world_size=1) == {
        "rng_state.pth": ("python", "numpy", "cpu")
    }


def test_weights_lacking_a_tensor_are_refused_naming_it(tiny_model, checkpoint):
    """The model trained on with the tensor as initialised; transformers' "missing keys" line alone showed it."""
    weights = load_file(checkpoint / "model.safetensors")
    del weights["model.norm.weight"]
    save_file(weights, checkpoint / "model.safetensors", metadata={"format": "pt"})
    write_manifest(checkpoint)
    with pytest.raises(ValueError) as raised:
        resume(tiny_model, checkpoint)
    assert str(raised.value) == (
        f"model.safetensors of resume_from_checkpoint={str(checkpoint)!r} lacks 1 tensor(s) of the model "
        "(model.norm.weight): the file is damaged or holds another model, and these would train on as initialised. "
        "Resume from an earlier checkpoint of this run."
    )


def test_a_negative_global_step_is_refused(tiny_model, tmp_path):
    """global_step -3 trained from -3 to max_steps: 8 steps where 5 were asked for. Refused as a path; skipped by
    resume_from_checkpoint=True for the complete checkpoint before it."""
    make_trainer(tiny_model, tmp_path, max_steps=2).train()
    checkpoint = tmp_path / "checkpoint-2"
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    state["global_step"] = -3
    (checkpoint / "trainer_state.json").write_text(json.dumps(state))
    write_manifest(checkpoint)
    trainer = make_trainer(tiny_model, tmp_path, max_steps=5)
    with pytest.raises(ValueError, match=r"is not a complete checkpoint: trainer_state.json holds global_step=-3, "):
        trainer.train(resume_from_checkpoint=str(checkpoint))
    resumed = make_trainer(tiny_model, tmp_path, max_steps=3)
    resumed.train(resume_from_checkpoint=True)
    assert steps_logged(resumed) == [1, 2, 3]  # from checkpoint-1


def generating_trainer(model, output_dir, **overrides):
    """TRL's own generation (no scripted rollout): the path that calls transformers' checkpointing aliases."""
    settings = dict(per_device_train_batch_size=8, learning_rate=1e-3, max_steps=2, dynamic_sampling=False)
    return DAPOTrainer(
        model=model,
        reward_funcs=length_reward,
        args=dapo_args(output_dir, **{**settings, **overrides}),
        train_dataset=arithmetic_prompts(16),
    )


def test_a_correct_resume_logs_no_missing_key_and_warns_of_no_renamed_checkpointing(tiny_model, tmp_path, caplog):
    """Before: every run warned four times that `gradient_checkpointing` (TRL's default True), and the model's
    `is_gradient_checkpointing`, `gradient_checkpointing_disable` and `_enable` (which TRL calls) are deprecated
    (transformers 5.25), and every resume logged `missing keys ['lm_head.weight']`, the tied embedding that the
    weights store once. Checkpointing stays on, under its new name."""
    generating_trainer(tiny_model, tmp_path, max_steps=1, save_strategy="steps", save_steps=1).train()
    transformers_logger = logging.getLogger("transformers")
    transformers_logger.addHandler(caplog.handler)  # transformers' logs do not propagate
    try:
        with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.WARNING):
            warnings.simplefilter("always")
            resumed = generating_trainer(tiny_model, tmp_path, save_strategy="steps", save_steps=1)
            resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-1"))
    finally:
        transformers_logger.removeHandler(caplog.handler)
    assert resumed.state.global_step == 2
    assert "missing keys" not in caplog.text
    assert [str(w.message) for w in caught if "checkpointing" in str(w.message)] == []
    assert resumed.args.activation_checkpointing and resumed.model.is_activation_checkpointing


def test_gradient_checkpointing_set_off_reaches_the_new_name(tmp_path):
    assert dapo_args(tmp_path, gradient_checkpointing=False).activation_checkpointing is False
    assert dapo_args(tmp_path).activation_checkpointing is True  # TRL's default
