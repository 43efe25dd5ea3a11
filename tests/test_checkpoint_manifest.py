"""A complete checkpoint is every file its save wrote, as written: a manifest written last (names, sizes, SHA-256 of the
small files), each file and folder synced before it. A folder that fails it is skipped (`resume_from_checkpoint=True`)
or refused (a path), naming what is wrong; non-finite weights are refused on load; a full disk names the path."""

import errno
import hashlib
import json
import logging
import os
import shutil

import pytest
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from test_checkpoint_safety import make_trainer, steps_logged
from transformers import modeling_utils

from trl_dapo.trainer.safety import checkpoint_manifest
from trl_dapo.trainer.safety.checkpoint_files import SAMPLING_STATE_FILE
from trl_dapo.trainer.safety.checkpoint_manifest import MANIFEST_FILE, write_manifest


@pytest.fixture(scope="module")
def two_checkpoints(tiny_model, tmp_path_factory):
    """A 2-step run's output folder, checkpoint-1 and checkpoint-2: each test damages a copy of it."""
    folder = tmp_path_factory.mktemp("two-checkpoints")
    make_trainer(tiny_model, folder).train()
    return folder


@pytest.fixture
def copied(two_checkpoints, tmp_path):
    shutil.copytree(two_checkpoints, tmp_path, dirs_exist_ok=True)
    return tmp_path


def manifest_of(checkpoint):
    return json.loads((checkpoint / MANIFEST_FILE).read_text())


def test_the_manifest_lists_every_file_the_save_wrote_with_its_size_and_checksum(two_checkpoints):
    checkpoint = two_checkpoints / "checkpoint-2"
    files = manifest_of(checkpoint)["files"]
    on_disk = {p.relative_to(checkpoint).as_posix() for p in checkpoint.rglob("*") if p.is_file()}
    assert set(files) == on_disk - {MANIFEST_FILE}
    assert {"optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json", SAMPLING_STATE_FILE} <= set(files)
    for name, entry in files.items():
        data = (checkpoint / name).read_bytes()
        assert entry == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}, name  # all small here


def test_files_above_the_checksum_limit_are_listed_by_size_only(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint_manifest, "CHECKSUM_LIMIT", 100)
    (tmp_path / "small.json").write_bytes(b"x" * 100)
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / "large.bin").write_bytes(b"y" * 101)
    write_manifest(tmp_path)
    assert manifest_of(tmp_path)["files"] == {
        "small.json": {"bytes": 100, "sha256": hashlib.sha256(b"x" * 100).hexdigest()},
        "shards/large.bin": {"bytes": 101},
    }


def trainer_state_of_the_same_size_changed(checkpoint):
    """The step of its first log entry changed from 1 to 7: same size, another content."""
    path = checkpoint / "trainer_state.json"
    text = path.read_text()
    changed = text.replace('"step": 1', '"step": 7', 1)
    assert changed != text and len(changed) == len(text)
    path.write_text(changed)


DAMAGES = {
    "no optimizer.pt": (lambda c: (c / "optimizer.pt").unlink(), "optimizer.pt missing"),
    "no scheduler.pt": (lambda c: (c / "scheduler.pt").unlink(), "scheduler.pt missing"),
    "no rng_state.pth": (lambda c: (c / "rng_state.pth").unlink(), "rng_state.pth missing"),
    "trainer_state {}": (lambda c: (c / "trainer_state.json").write_text("{}"), "trainer_state.json has 2 bytes, "),
    "trainer_state []": (lambda c: (c / "trainer_state.json").write_text("[]"), "trainer_state.json has 2 bytes, "),
    "weights cut by a byte": (
        lambda c: os.truncate(c / "model.safetensors", (c / "model.safetensors").stat().st_size - 1),
        "model.safetensors has ",
    ),
    "trainer_state changed": (trainer_state_of_the_same_size_changed, "trainer_state.json differs from the file"),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_resume_true_skips_a_checkpoint_that_fails_its_manifest_naming_what_is_wrong(
    tiny_model, copied, caplog, damage
):
    """Before the manifest, each of these counted as complete: the run resumed from checkpoint-2 with a fresh
    optimizer or RNG state, or failed with a TypeError on a trainer_state.json of {} or []."""
    damaged, reason = DAMAGES[damage]
    newest = copied / "checkpoint-2"
    damaged(newest)
    resumed = make_trainer(tiny_model, copied, max_steps=2)
    with caplog.at_level(logging.WARNING, logger="trl_dapo"):
        resumed.train(resume_from_checkpoint=True)
    assert steps_logged(resumed) == [1, 2] and resumed.state.global_step == 2  # step 2 trained again
    assert f"resuming from {copied / 'checkpoint-1'}, the newest complete checkpoint" in caplog.text
    assert f"skipped as incomplete: {newest} ({reason}" in caplog.text


@pytest.mark.parametrize("damage", ["no optimizer.pt", "trainer_state []"])
def test_a_checkpoint_path_that_fails_its_manifest_is_refused_with_the_reason(tiny_model, copied, damage):
    damaged, reason = DAMAGES[damage]
    damaged(copied / "checkpoint-2")
    trainer = make_trainer(tiny_model, copied, max_steps=3)
    with pytest.raises(ValueError, match=f"is not a complete checkpoint: {reason}") as raised:
        trainer.train(resume_from_checkpoint=str(copied / "checkpoint-2"))
    assert str(copied / "checkpoint-2") in str(raised.value)
    assert trainer.state.global_step == 0


def as_saved_before_manifests(checkpoint):
    """`checkpoint` as an earlier trl-dapo saved it: no manifest, and a sampling state that does not say it has one."""
    (checkpoint / MANIFEST_FILE).unlink()
    state = torch.load(checkpoint / SAMPLING_STATE_FILE, weights_only=True)
    del state["writes_manifest"]
    torch.save(state, checkpoint / SAMPLING_STATE_FILE)


def test_a_checkpoint_saved_before_manifests_resumes_with_a_warning(tiny_model, copied, caplog):
    """Accepted when its Trainer state and the files a resume reads are there, with a warning that its sizes are not
    checked; without one of those files it is skipped as before."""
    as_saved_before_manifests(copied / "checkpoint-2")
    resumed = make_trainer(tiny_model, copied, max_steps=3)
    with caplog.at_level(logging.WARNING, logger="trl_dapo"):
        resumed.train(resume_from_checkpoint=True)
    assert steps_logged(resumed) == [1, 2, 3]
    assert f"resume_from_checkpoint={str(copied / 'checkpoint-2')!r} has no {MANIFEST_FILE}" in caplog.text


@pytest.mark.parametrize("kind", ["saved before manifests, no optimizer.pt", "this version's, no manifest"])
def test_a_checkpoint_without_a_manifest_missing_a_file_or_interrupted_is_skipped(tiny_model, copied, caplog, kind):
    newest = copied / "checkpoint-2"
    if kind.startswith("saved before"):
        as_saved_before_manifests(newest)
        (newest / "optimizer.pt").unlink()
        reason = "no optimizer.pt"
    else:  # killed after trainer_state.json, before the manifest
        (newest / MANIFEST_FILE).unlink()
        reason = f"no {MANIFEST_FILE}: the save was interrupted before its end"
    resumed = make_trainer(tiny_model, copied, max_steps=2)
    with caplog.at_level(logging.WARNING, logger="trl_dapo"):
        resumed.train(resume_from_checkpoint=True)
    assert steps_logged(resumed) == [1, 2]
    assert f"skipped as incomplete: {newest} ({reason})" in caplog.text


def test_non_finite_weights_in_a_checkpoint_are_refused_on_load(tiny_model, copied):
    """A checkpoint complete by its manifest whose weights hold a NaN (an earlier version's, or damaged): refused
    when loaded, naming the parameter, before sampling fails on it with "probability tensor contains inf/nan"."""
    checkpoint = copied / "checkpoint-2"
    weights = load_file(checkpoint / "model.safetensors")
    weights["model.norm.weight"][3] = float("nan")
    save_file(weights, checkpoint / "model.safetensors", metadata={"format": "pt"})
    write_manifest(checkpoint)
    trainer = make_trainer(tiny_model, copied, max_steps=3)
    with pytest.raises(ValueError, match=r"holds non-finite weights \(model\.norm\.weight\)"):
        trainer.train(resume_from_checkpoint=str(checkpoint))


def test_files_and_folders_are_synced_before_the_manifest_and_older_checkpoints_deleted_after(
    tiny_model, tmp_path, monkeypatch
):
    """No test can pull the plug: the order of `os.fsync` and `os.replace` calls is what makes a renamed file or a
    manifest stand for data on the disk. Per save: DAPO's file synced, renamed, its folder synced; every file, then
    the folder; the manifest synced, renamed; the folder and output_dir synced; only then the older one deleted."""
    events = []
    fsync, replace = os.fsync, os.replace

    def recorded_fsync(descriptor):
        path = os.readlink(f"/proc/self/fd/{descriptor}")
        events.append(("fsync", path, (tmp_path / "checkpoint-1").exists()))
        return fsync(descriptor)

    def recorded_replace(source, target):
        events.append(("replace", str(target), None))
        return replace(source, target)

    monkeypatch.setattr(os, "fsync", recorded_fsync)
    monkeypatch.setattr(os, "replace", recorded_replace)
    make_trainer(tiny_model, tmp_path, save_total_limit=1).train()
    monkeypatch.undo()

    checkpoint = tmp_path / "checkpoint-2"
    assert not (tmp_path / "checkpoint-1").exists()
    start = next(i for i, event in enumerate(events) if event[1].startswith(str(checkpoint)))  # checkpoint-2's save
    ours = [event for event in events[start:] if event[1].startswith(str(checkpoint)) or event[1] == str(tmp_path)]
    sampling = str(checkpoint / SAMPLING_STATE_FILE)
    files = [str(checkpoint / name) for name in sorted(manifest_of(checkpoint)["files"])]
    manifest = str(checkpoint / MANIFEST_FILE)
    expected = (
        [("fsync", f"{sampling}.partial"), ("replace", sampling), ("fsync", str(checkpoint))]
        + [("fsync", path) for path in files]
        + [("fsync", str(checkpoint)), ("fsync", f"{manifest}.partial"), ("replace", manifest)]
        + [("fsync", str(checkpoint)), ("fsync", str(tmp_path))]
    )
    assert [event[:2] for event in ours] == expected
    assert all(exists for kind, _, exists in ours if kind == "fsync")  # checkpoint-1 deleted after the last


def torch_save_failing(monkeypatch, name: str, message: str) -> None:
    """torch.save into checkpoint-2's `name` writes part of the file, then raises `message`, as on a full disk."""
    save = torch.save

    def full_disk(obj, path, *args, **kwargs):
        if f"checkpoint-2{os.sep}{name}" in str(path):
            with open(path, "wb") as file:
                file.write(b"PK")
            raise RuntimeError(message)
        return save(obj, path, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full_disk)


def safetensors_failing(monkeypatch, name: str, message: str) -> None:
    """safetensors' save of the weights raises `message` (it deletes its file), as on a full disk."""
    save = modeling_utils.safe_save_file

    def full_disk(tensors, path, *args, **kwargs):
        if f"checkpoint-2{os.sep}" in str(path):
            raise SafetensorError(message)
        return save(tensors, path, *args, **kwargs)

    monkeypatch.setattr(modeling_utils, "safe_save_file", full_disk)


FULL_DISKS = {  # the file, what fails writing it (as seen on a full tmpfs), and what the error says
    "optimizer.pt": (torch_save_failing, "[enforce fail at inline_container.cc:672] . unexpected pos 832 vs 726"),
    "scheduler.pt": (torch_save_failing, "basic_ios::clear: iostream error"),
    SAMPLING_STATE_FILE: (torch_save_failing, "[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0"),
    "model.safetensors": (
        safetensors_failing,
        "Error while serializing: I/O error: No space left on device (os error 28)",
    ),
}


@pytest.mark.parametrize("file", list(FULL_DISKS))
def test_a_full_disk_while_saving_names_the_checkpoint_and_the_file_and_keeps_the_last_checkpoint(
    tiny_model, tmp_path, monkeypatch, file
):
    """torch.save on a full disk raised "[enforce fail at inline_container.cc:672] unexpected pos 832 vs 726" or
    "basic_ios::clear: iostream error", safetensors "Error while serializing: I/O error: No space left on device":
    none named the checkpoint or the file. Now the error names both and the space left; where the message does not
    say the disk is full (basic_ios) and the disk has room, that the write failed."""
    failing, message = FULL_DISKS[file]
    failing(monkeypatch, file, message)
    with pytest.raises(OSError) as raised:
        make_trainer(tiny_model, tmp_path, save_total_limit=1).train()
    monkeypatch.undo()
    named = "the model weights (*.safetensors)" if file == "model.safetensors" else file
    what = f"{named} into checkpoint {tmp_path / 'checkpoint-2'}"
    said = f"writing {what} failed" if "basic_ios" in message else f"no space left on the disk while writing {what}"
    error = raised.value
    assert error.errno == (errno.EIO if "basic_ios" in message else errno.ENOSPC)
    assert error.strerror.startswith(f"{said} (")
    kind = "SafetensorError" if file == "model.safetensors" else "RuntimeError"
    assert f" bytes free; {kind}: {message}). " in error.strerror
    assert error.strerror.endswith("free space (or set output_dir on a larger disk) and resume.")
    assert manifest_of(tmp_path / "checkpoint-1")  # kept, complete
    assert not (tmp_path / "checkpoint-2" / MANIFEST_FILE).exists()
    assert not list(tmp_path.rglob("*.partial"))


def folder_bytes(folder):
    return {path.relative_to(folder): path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file()}


def test_a_damaged_manifest_never_costs_the_only_checkpoint(tiny_model, tmp_path):
    """A finished run with save_total_limit=1 keeps checkpoint-2 alone; its manifest cut to 100 bytes. Resumed with
    True it was skipped with a warning, training started from step 0 and deleted it on saving checkpoint-1. Now both
    True and its path are refused, naming it and the ways on, and it stays as it was; a new manifest written as the
    error says lets it resume."""
    make_trainer(tiny_model, tmp_path, save_total_limit=1).train()
    checkpoint = tmp_path / "checkpoint-2"
    os.truncate(checkpoint / MANIFEST_FILE, 100)
    saved = folder_bytes(checkpoint)
    for requested in (True, str(checkpoint)):
        trainer = make_trainer(tiny_model, tmp_path, save_total_limit=1, max_steps=3)
        with pytest.raises(ValueError) as raised:
            trainer.train(resume_from_checkpoint=requested)
        assert str(raised.value) == (
            f"{checkpoint}: its {MANIFEST_FILE} is damaged (100 bytes that are not a manifest), so the files its save "
            "wrote cannot be checked: it is neither resumed nor deleted. If its files are whole (the save ended and "
            'only the manifest was damaged), write a new manifest of them with python -c "from '
            f"trl_dapo.trainer.safety import write_manifest; write_manifest('{checkpoint}')\" and resume; otherwise "
            "move the folder out of output_dir, and resume_from_checkpoint=True takes the next older complete "
            "checkpoint (none: step 0)."
        )
        assert trainer.state.global_step == 0
    assert sorted(path.name for path in tmp_path.glob("checkpoint-*")) == ["checkpoint-2"]
    assert folder_bytes(checkpoint) == saved

    write_manifest(checkpoint)
    resumed = make_trainer(tiny_model, tmp_path, save_total_limit=1, max_steps=3)
    resumed.train(resume_from_checkpoint=True)
    assert steps_logged(resumed) == [1, 2, 3]  # step 3 trained from checkpoint-2


def test_resume_true_does_not_start_over_a_checkpoint_that_changed_since_its_save(tiny_model, tmp_path):
    """The only checkpoint fails its manifest (its optimizer.pt deleted): training started from step 0 and, with
    save_total_limit=1, deleted it. Now refused, naming it and what changed; with an older complete checkpoint it is
    skipped as before (`test_resume_true_skips_a_checkpoint_that_fails_its_manifest_naming_what_is_wrong`)."""
    make_trainer(tiny_model, tmp_path, save_total_limit=1).train()
    checkpoint = tmp_path / "checkpoint-2"
    (checkpoint / "optimizer.pt").unlink()
    trainer = make_trainer(tiny_model, tmp_path, save_total_limit=1, max_steps=3)
    with pytest.raises(ValueError) as raised:
        trainer.train(resume_from_checkpoint=True)
    assert str(raised.value) == (
        f"resume_from_checkpoint=True found no complete checkpoint in output_dir={str(tmp_path)!r}, and this one was "
        f"saved whole (a {MANIFEST_FILE} lists its files) but changed since: {checkpoint} (optimizer.pt missing). "
        "Starting from step 0 would delete or overwrite it. Restore the files named, or move the folder out of "
        "output_dir to start from step 0 (its weights can start a new run: model=<the folder>)."
    )
    assert sorted(path.name for path in tmp_path.glob("checkpoint-*")) == ["checkpoint-2"]
