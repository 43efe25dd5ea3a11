"""DeepSpeed ZeRO-2 and ZeRO-3 (the recipes' accelerate configs) on two CPU ranks (gloo), or a rank per GPU (at most
two): an optimizer step dynamic sampling skips (no informative group) must leave DeepSpeed's float32 weights, AdamW's
state and the model's parameters as they were on every rank, while the step counts: the learning-rate schedule
advances and `dapo/skipped_steps` counts it. So must a step whose gradient holds a NaN, counted in
`dapo/nonfinite_steps`."""

import pytest
import torch

from helpers import launch_worker

pytest.importorskip("deepspeed")


@pytest.fixture(scope="module", params=["zero2", "zero3"])
def ranks(request, tiny_model, tmp_path_factory) -> list[dict]:
    """The recipes' own ZeRO accelerate configs, launched on two CPU processes."""
    output = str(tmp_path_factory.mktemp("deepspeed") / "run")
    ranks = min(2, torch.cuda.device_count()) if torch.cuda.is_available() else 2  # a rank per GPU on a GPU machine
    launch_worker("deepspeed_worker.py", ranks, tiny_model, output, config=request.param)
    return [torch.load(f"{output}.rank{rank}.pt", weights_only=True) for rank in range(ranks)]


def assert_equal(after: dict, before: dict) -> None:
    for part in ("fp32_weights", "adam_state"):
        assert len(after[part]) == len(before[part]) > 0
        for index, (value, earlier) in enumerate(zip(after[part], before[part], strict=True)):
            if isinstance(value, dict):
                assert value.keys() == earlier.keys()
                assert all(torch.equal(value[k], earlier[k]) for k in value), f"{part}[{index}] moved"
            else:
                assert torch.equal(value, earlier), f"{part}[{index}] moved"
    for name, value in after["parameters"].items():
        assert torch.equal(value, before["parameters"][name]), name


@pytest.mark.distributed
def test_a_skipped_step_leaves_deepspeed_weights_and_adam_state_unchanged_on_every_rank(ranks):
    for rank in ranks:
        begin, trained, skipped, _ = rank["steps"]
        assert rank["global_step"] == 3 and rank["skipped_steps"] == [0.0, 1.0, 1.0]
        assert any(not torch.equal(a, b) for a, b in zip(trained["fp32_weights"], begin["fp32_weights"], strict=True))
        assert any(
            not torch.equal(value, begin["parameters"][name]) for name, value in trained["parameters"].items()
        ), "the first step must train"
        assert_equal(skipped, trained)
        # the step still counts: linear decay from 1e-2 to 0 over 3 steps, the second step's rate is two thirds
        assert rank["learning_rate"][:2] == pytest.approx([1e-2, 2e-2 / 3])


@pytest.mark.distributed
def test_a_non_finite_gradient_is_skipped_by_deepspeed_and_counted_on_every_rank(ranks):
    """The third step's gradient holds a NaN: DeepSpeed's overflow check skips the update (weights and AdamW's state as
    the second step left them), and the step is counted in `dapo/nonfinite_steps`, the first one not."""
    for rank in ranks:
        _, _, skipped, poisoned = rank["steps"]
        assert rank["nonfinite_steps"] == [0.0, 0.0, 1.0]
        assert_equal(poisoned, skipped)
