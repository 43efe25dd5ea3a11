"""A real 2-process data-parallel run (accelerate, gloo, CPU) against a 1-process run of the same global batch."""

from pathlib import Path

import pytest
import torch

from helpers import launch_worker


def launch(processes: int, model: str, output: Path) -> dict:
    launch_worker("dist_worker.py", processes, model, output)
    return torch.load(output, weights_only=False)


@pytest.fixture(scope="module")
def runs(tiny_model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("dist")
    return launch(1, tiny_model, folder / "one.pt"), launch(2, tiny_model, folder / "two.pt")


@pytest.mark.distributed
def test_two_ranks_accept_the_same_groups_as_one(runs):
    one, two = runs
    assert len(one["rows"]) == 32
    assert one["rows"] == two["rows"]  # same prompts, completions, advantages, same order
    metrics = two["metrics"][0]
    assert metrics["dapo/gen_batches"] > 1 and metrics["dapo/filtered_groups"] > 0  # filtering and retries happened
    assert metrics["dapo/qualified_groups"] >= 8


@pytest.mark.distributed
def test_two_ranks_make_the_same_parameter_update_as_one(runs, tiny_model):
    from transformers import AutoModelForCausalLM

    one, two = runs
    initial = dict(AutoModelForCausalLM.from_pretrained(tiny_model).named_parameters())
    moved = max((one["parameters"][k] - p).abs().max().item() for k, p in initial.items())
    assert moved > 1e-4, "the step must actually move the parameters"
    for name, value in one["parameters"].items():
        torch.testing.assert_close(two["parameters"][name], value, atol=1e-6, rtol=0, msg=name)
