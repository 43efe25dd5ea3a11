"""The rollout engine's weights read from sharded parameters: FSDP2 over 2 CPU processes (gloo) against the same
weights unsharded, and a snapshot built where the model has no weights yet (a rank that loads none).

ZeRO-3's gather needs DeepSpeed and a GPU; it runs in `benchmarks/multi_gpu/bench_multi_gpu.py --rollout`.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers import launch_worker
from trl_dapo.rollout import PagedRolloutEngine

LAYOUTS = ["accelerate", "layers_and_root", "accelerate_lora"]


@pytest.fixture(scope="module")
def ranks(tiny_model, tmp_path_factory):
    output = tmp_path_factory.mktemp("fsdp") / "run"
    launch_worker("fsdp_worker.py", 2, tiny_model, output)
    return [torch.load(f"{output}.rank{rank}.pt", weights_only=False) for rank in range(2)]


def assert_same_tensors(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(actual[name], tensor, rtol=0, atol=0, msg=name)


def assert_same_generations(actual: dict, expected: dict) -> None:
    for settings, (ids, logprobs) in expected.items():
        assert actual[settings][0] == ids, settings
        torch.testing.assert_close(actual[settings][1], logprobs, rtol=0, atol=0, msg=settings)


@pytest.mark.distributed
@pytest.mark.parametrize("layout", LAYOUTS)
def test_engine_on_fsdp2_shards_generates_what_the_unsharded_model_does(ranks, layout):
    for rank in ranks:
        run = rank[layout]
        assert set(run["shard_fractions"].values()) == {0.5} and len(run["shard_fractions"]) == run["parameters"]
        assert run["in_place"]  # the sync wrote into the tensors the engine was built with
        assert_same_tensors(run["snapshot"], run["unsharded_snapshot"])
        assert_same_generations(run["sharded"], run["unsharded"])  # greedy and sampled: ids and logprobs
        assert sum(len(ids) for ids in run["sharded"]["greedy"][0]) > 20


@pytest.mark.distributed
@pytest.mark.parametrize("layout", LAYOUTS)
def test_snapshot_after_an_optimizer_step_equals_the_gathered_updated_weights(ranks, layout):
    for rank in ranks:
        run = rank[layout]
        assert run["moved"] > 0.1  # the step changed the weights, so a stale snapshot would differ
        assert_same_tensors(run["stepped_snapshot"], run["stepped_unsharded_snapshot"])
        assert_same_tensors(run["built_from_shards"], run["stepped_unsharded_snapshot"])
        assert_same_generations(run["stepped_sharded"], run["stepped_unsharded"])
    # each rank trained on its own batch; the reduced update is the same on both
    assert_same_tensors(ranks[1][layout]["stepped_snapshot"], ranks[0][layout]["stepped_snapshot"])


def test_a_snapshot_of_a_model_without_weights_is_filled_by_the_first_sync(tiny_model):
    """With FSDP's RAM-efficient loading, ranks but the first build the trainer on a meta-device model."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    with torch.device("meta"):
        empty = AutoModelForCausalLM.from_config(model.config)
    options = dict(eos_token_ids=[2], pad_token_id=0, dtype=torch.float32, cuda_graph=False, device="cpu")
    rollout = PagedRolloutEngine(empty, **options)
    assert all(tensor.device.type == "cpu" for tensor in rollout.snapshot.tensors.values())
    rollout.sync_weights(model)
    assert_same_tensors(rollout.snapshot.tensors, PagedRolloutEngine(model, **options).snapshot.tensors)


@pytest.mark.distributed
def test_a_padding_free_pass_through_fsdp2_shards_gives_the_unsharded_gradients(ranks):
    """Rank 0 packs uneven rows, rank 1 runs an empty pass (every rank runs as many passes: the sharded forward and
    backward are collectives); the gradients are the unsharded model's for rank 0's rows."""
    for rank in ranks:
        result = rank["padding_free"]
        assert result["sharded"].keys() == result["unsharded"].keys() and result["unsharded"]
        for name, grad in result["unsharded"].items():
            torch.testing.assert_close(result["sharded"][name], grad, atol=1e-5, rtol=1e-4, msg=name)
