"""Crash-safe checkpoints and exact resume: a kill while saving (simulated by a DAPO file's write that fails half-way)
leaves an older checkpoint to resume from, `resume_from_checkpoint=True` picks the newest complete checkpoint, and a
run resumed in a later epoch trains what the uninterrupted one did."""

import logging
import shutil

import pytest
import torch
from accelerate.data_loader import BatchSamplerShard, DataLoaderShard, SkipBatchSampler
from torch.utils.data import BatchSampler
from transformers import AutoTokenizer
from trl.trainer.utils import RepeatSampler

from helpers import arithmetic_prompts, dapo_args, length_reward
from trl_dapo import DAPOTrainer
from trl_dapo.testing import ScriptedRollout
from trl_dapo.trainer.safety.checkpoint_files import SAMPLING_STATE_FILE
from trl_dapo.trainer.safety.epoch_order import EpochOrder, set_resumed_epoch

# scripted rows and no dynamic sampling: quick steps, and no extra rounds
QUICK = dict(max_steps=2, save_strategy="steps", save_steps=1, dynamic_sampling=False)


def make_trainer(tiny_model, output_dir, train_dataset=None, **overrides):
    settings = dict(per_device_train_batch_size=8, learning_rate=1e-3, **QUICK)
    settings.update(overrides)
    return DAPOTrainer(
        model=tiny_model,
        reward_funcs=length_reward,
        args=dapo_args(output_dir, **settings),
        train_dataset=train_dataset if train_dataset is not None else arithmetic_prompts(40),
        rollout_func=ScriptedRollout(AutoTokenizer.from_pretrained(tiny_model)),
    )


@pytest.fixture(scope="module")
def two_checkpoints(tiny_model, tmp_path_factory):
    """A 2-step run's output folder, checkpoint-1 and checkpoint-2: each test damages a copy of it."""
    folder = tmp_path_factory.mktemp("two-checkpoints")
    make_trainer(tiny_model, folder).train()
    return folder


def steps_logged(trainer):
    return [h["step"] for h in trainer.state.log_history if "loss" in h]


def killed_while_saving(monkeypatch, step: int):
    """`torch.save` of DAPO's sampling state at `step` writes half a file under the name it is given, then raises: a
    process killed in the middle of that write."""
    save = torch.save

    def dies_half_way(obj, path, *args, **kwargs):
        if SAMPLING_STATE_FILE in str(path) and f"checkpoint-{step}" in str(path):
            save(obj, path, *args, **kwargs)
            with open(path, "r+b") as file:
                file.truncate(file.seek(0, 2) // 2)
            raise KeyboardInterrupt("killed")
        return save(obj, path, *args, **kwargs)

    monkeypatch.setattr(torch, "save", dies_half_way)


def test_a_kill_while_saving_keeps_the_last_complete_checkpoint(tiny_model, tmp_path, monkeypatch, caplog):
    """save_total_limit=1: before the fix TRL wrote checkpoint-2's trainer_state.json and deleted checkpoint-1, then
    the sampling state's write died, leaving only the incomplete checkpoint-2 (a truncated sampling state). Now no
    older checkpoint goes before the new one is complete, and DAPO's files reach their names only when written."""
    killed_while_saving(monkeypatch, step=2)
    with pytest.raises(KeyboardInterrupt):
        make_trainer(tiny_model, tmp_path, save_total_limit=1).train()
    monkeypatch.undo()
    assert (tmp_path / "checkpoint-1" / "trainer_state.json").exists()
    assert (tmp_path / "checkpoint-1" / SAMPLING_STATE_FILE).exists()
    assert not (tmp_path / "checkpoint-2" / SAMPLING_STATE_FILE).exists()  # never a half-written file by its name

    resumed = make_trainer(tiny_model, tmp_path, save_total_limit=1, max_steps=3)
    with caplog.at_level(logging.WARNING, logger="trl_dapo"):
        resumed.train(resume_from_checkpoint=True)
    assert steps_logged(resumed) == [1, 2, 3]  # step 1 from checkpoint-1's log, then 2 and 3 trained
    assert f"{tmp_path / 'checkpoint-2'}" in caplog.text
    assert sorted(path.name for path in tmp_path.glob("checkpoint-*")) == ["checkpoint-3"]


@pytest.mark.parametrize("damage", ["empty", "no trainer_state.json", f"no {SAMPLING_STATE_FILE}", "torn json"])
def test_resume_true_skips_an_incomplete_newest_checkpoint_and_names_it(
    tiny_model, two_checkpoints, tmp_path, caplog, damage
):
    shutil.copytree(two_checkpoints, tmp_path, dirs_exist_ok=True)
    newest = tmp_path / "checkpoint-2"
    if damage == "empty":
        newest = tmp_path / "checkpoint-3"
        newest.mkdir()
    elif damage == "torn json":
        state = newest / "trainer_state.json"
        state.write_text(state.read_text()[:40])
    else:
        (newest / damage.removeprefix("no ")).unlink()

    resumed = make_trainer(tiny_model, tmp_path, max_steps=3)
    with caplog.at_level(logging.WARNING, logger="trl_dapo"):
        resumed.train(resume_from_checkpoint=True)
    resumed_from = tmp_path / ("checkpoint-2" if damage == "empty" else "checkpoint-1")
    assert steps_logged(resumed) == [1, 2, 3] and resumed.state.global_step == 3
    assert f"resume_from_checkpoint=True: resuming from {resumed_from}, " in caplog.text
    assert f"skipped as incomplete: {newest} (" in caplog.text


def test_resume_true_without_a_checkpoint_starts_from_step_0_with_a_warning(tiny_model, tmp_path, caplog):
    trainer = make_trainer(tiny_model, tmp_path, max_steps=1)
    with caplog.at_level(logging.WARNING, logger="trl_dapo"):
        trainer.train(resume_from_checkpoint=True)
    assert steps_logged(trainer) == [1]
    assert f"resume_from_checkpoint=True found no checkpoint in output_dir={str(tmp_path)!r}" in caplog.text


EPOCHS = dict(max_steps=4, train_dataset=arithmetic_prompts(4))  # 4 prompts, 2 a step: an epoch is 2 steps


@pytest.fixture(scope="module")
def two_epochs(tiny_model, tmp_path_factory):
    """An uninterrupted run over two epochs, a checkpoint after each step: its folder and final weights."""
    folder = tmp_path_factory.mktemp("two-epochs")
    straight = make_trainer(tiny_model, folder, **EPOCHS)
    straight.train()
    assert straight.state.epoch == 2.0
    return folder, {name: p.detach().clone() for name, p in straight.model.named_parameters()}


@pytest.mark.parametrize("checkpoint", [2, 3], ids=["at-the-first-epochs-end", "inside-the-second-epoch"])
def test_a_run_resumed_in_a_later_epoch_equals_the_uninterrupted_run(tiny_model, two_epochs, tmp_path, checkpoint):
    """TRL's sampler draws each epoch's order from one generator that a resumed run built afresh, so it drew the
    first epoch's order again (0.02 max |dW| at step 30 of the demo resumed from step 10). Now each epoch's order is
    restored: the resumed run's weights equal the uninterrupted run's exactly."""
    folder, weights = two_epochs
    resumed = make_trainer(tiny_model, tmp_path, **EPOCHS)
    resumed.train(resume_from_checkpoint=str(folder / f"checkpoint-{checkpoint}"))
    for name, value in resumed.model.named_parameters():
        torch.testing.assert_close(value.detach(), weights[name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("processes", [1, 2])
def test_the_resumed_epoch_reaches_the_sampler_under_accelerates_wrappers(processes):
    """accelerate wraps the batch sampler in a shard per process (several processes) and, to skip the trained
    batches, in a `SkipBatchSampler`, whose `set_epoch` does not reach the sampler under a shard: the trainer sets it.
    Each epoch's order is then the one an uninterrupted iteration gives."""
    dataset = list(range(6))
    straight = EpochOrder(RepeatSampler(dataset, mini_repeat_count=1, batch_size=2, seed=5))
    uninterrupted = []
    for epoch in range(3):
        straight.set_epoch(epoch)
        uninterrupted.append(list(straight))
    sampler = EpochOrder(RepeatSampler(dataset, mini_repeat_count=1, batch_size=2, seed=5))  # the resumed run's
    batches = BatchSampler(sampler, 2, drop_last=False)
    if processes > 1:
        batches = BatchSamplerShard(batches, num_processes=processes, process_index=0)
    skipping = DataLoaderShard(dataset, batch_sampler=SkipBatchSampler(batches, skip_batches=1))
    set_resumed_epoch(skipping, 2)
    skipping.set_epoch(2)  # as the Trainer does next
    assert list(sampler) == uninterrupted[2] != uninterrupted[0]


def folder_bytes(folder):
    return {path.relative_to(folder): path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file()}


def test_a_finished_run_restarted_trains_nothing_and_keeps_its_last_checkpoint(tiny_model, tmp_path, caplog):
    """A job scheduler restarting a finished job: its newest checkpoint is at max_steps, inside an epoch (20 steps
    here). The Trainer trained step 3 and, with save_total_limit=1, deleted checkpoint-2. Now nothing is trained and
    checkpoint-2 stays as it was, with a warning saying so; a max_steps below the checkpoint's step is the same."""
    make_trainer(tiny_model, tmp_path, save_total_limit=1).train()
    saved = folder_bytes(tmp_path / "checkpoint-2")
    for max_steps in (2, 1):
        restarted = make_trainer(tiny_model, tmp_path, save_total_limit=1, max_steps=max_steps)
        with caplog.at_level(logging.WARNING, logger="trl_dapo"):
            restarted.train(resume_from_checkpoint=True)
        assert restarted.state.global_step == 2 and steps_logged(restarted) == [1, 2]
        assert sorted(path.name for path in tmp_path.glob("checkpoint-*")) == ["checkpoint-2"]
        assert folder_bytes(tmp_path / "checkpoint-2") == saved
        assert (
            f"resume_from_checkpoint={str(tmp_path / 'checkpoint-2')!r} is at step 2, at or past max_steps="
            f"{max_steps}: nothing is trained" in caplog.text
        )
