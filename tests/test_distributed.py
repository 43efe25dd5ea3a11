"""A real 2-process data-parallel run against a 1-process run of the same global batch, and the tiny model built on
every rank: on the CPU (accelerate, gloo), and where CUDA runs, the same two ranks sharing the one GPU (gloo on CUDA
tensors, float32)."""

import json
from pathlib import Path

import pytest
import torch

from helpers import launch_worker, spawn_ranks

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def launch(processes: int, model: str, output: Path, device: str) -> dict:
    if device == "cuda":
        spawn_ranks("dist_worker.py", processes, model, str(output), "cuda", one_device=True, timeout=1200)
    else:
        launch_worker("dist_worker.py", processes, model, output)
    return torch.load(output, weights_only=True)


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=CUDA)])
def runs(request, tiny_model, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"dist-{request.param}")
    one = launch(1, tiny_model, folder / "one.pt", request.param)
    return one, launch(2, tiny_model, folder / "two.pt", request.param)


@pytest.mark.distributed
def test_two_ranks_accept_the_same_groups_as_one(runs):
    one, two = (run["scripted"] for run in runs)
    assert len(one["rows"]) == 32
    assert one["rows"] == two["rows"]  # same prompts, completions, advantages, same order
    metrics = two["metrics"][0]
    assert metrics["dapo/gen_batches"] > 1 and metrics["dapo/filtered_groups"] > 0  # filtering and retries happened
    assert metrics["dapo/qualified_groups"] >= 8


def assert_same_update(one: dict, two: dict, tiny_model: str) -> None:
    from transformers import AutoModelForCausalLM

    initial = dict(AutoModelForCausalLM.from_pretrained(tiny_model).named_parameters())
    moved = max((one["parameters"][k] - p).abs().max().item() for k, p in initial.items())
    assert moved > 1e-4, "the step must actually move the parameters"
    for name, value in one["parameters"].items():
        torch.testing.assert_close(two["parameters"][name], value, atol=1e-6, rtol=0, msg=name)


@pytest.mark.distributed
def test_two_ranks_make_the_same_parameter_update_as_one(runs, tiny_model):
    assert_same_update(runs[0]["scripted"], runs[1]["scripted"], tiny_model)


@pytest.mark.distributed
def test_a_partial_batch_with_empty_micro_batches_makes_the_same_update_on_two_ranks(runs, tiny_model):
    """Fewer informative groups than the batch needs, and fewer rows per rank than micro-batches: micro-batches no rank
    has rows for come first in the optimizer step, so its last one synchronises the gradients across ranks."""
    one, two = (run["partial"] for run in runs)
    metrics = two["metrics"][0]
    assert metrics["dapo/partial_batch"] == 1.0 and 1 <= metrics["dapo/qualified_groups"] <= 3
    rows = two["micro_batch_rows"]  # per rank, per micro-batch
    assert sum(map(sum, rows)) == 2 * int(metrics["dapo/qualified_groups"])  # 2 samples per group
    assert 0 in rows[0]  # some micro-batches are empty on a rank
    assert all(rank_rows[-1] >= 1 for rank_rows in rows if sum(rank_rows))  # the step's last one trains rows
    assert one["rows"] == two["rows"]
    assert_same_update(one, two, tiny_model)


@pytest.mark.distributed
@pytest.mark.parametrize("run", ["scripted", "recomputed"])
def test_padding_free_and_padded_passes_make_the_same_update_on_one_and_two_ranks(runs, tiny_model, run):
    """Padded, the step's rows are dealt to the ranks evenly by count, so the ranks train unequal token counts;
    padding-free, by tokens, so about equal ones. The update (and the old policy each rank recomputes for its own rows)
    must be the same whatever the deal, and the same as on one rank; so must the step's metrics."""
    for world in runs:
        assert world[run]["rows"] == world[run + "_padded"]["rows"]
        assert_same_update(world[run + "_padded"], world[run], tiny_model)
    packed, padded = runs[1][run], runs[1][run + "_padded"]
    assert [sum(rank) for rank in padded["micro_batch_rows"]] == [16, 16]
    padded_tokens = [sum(rank) for rank in padded["micro_batch_tokens"]]
    packed_tokens = [sum(rank) for rank in packed["micro_batch_tokens"]]
    assert padded_tokens[0] != padded_tokens[1] and sum(padded_tokens) == sum(packed_tokens)
    assert abs(packed_tokens[0] - packed_tokens[1]) <= 8  # balanced within one completion's length
    for name in ("loss", "entropy", "ratio_mean", "ratio_std", "clip_ratio/region_mean", "logprob_gap_max"):
        assert packed["metrics"][0][name] == pytest.approx(padded["metrics"][0][name], rel=1e-4, abs=1e-6), name


@pytest.mark.distributed
def test_a_rank_with_no_rows_in_a_step_runs_empty_passes_in_step_with_the_other(runs, tiny_model):
    """One informative group of 2 rows over 2 optimizer steps: on 2 ranks each step has one row, so one rank trains
    nothing; its empty passes (forward, backward, metrics, and the recompute pass of the old policy) keep it in step
    with the other rank, and the two updates are the 1-rank run's."""
    one, two = (run["sparse"] for run in runs)
    assert two["global_step"] == 2 and two["metrics"][0]["dapo/qualified_groups"] == 1
    rows = two["micro_batch_rows"]  # per rank, the generation batch's 8 micro-batches (2 steps)
    assert [sum(rank_rows) for rank_rows in rows] == [2, 0]  # each step's one row goes to the lower rank
    assert two["no_grad_forwards"][0] == two["no_grad_forwards"][1] > 0
    assert one["rows"] == two["rows"]
    assert_same_update(one, two, tiny_model)


@pytest.mark.distributed
def test_the_default_config_trains_on_one_and_two_processes(runs):
    one, two = (run["defaults"] for run in runs)
    assert (one["generation_batch_size"], two["generation_batch_size"]) == (16, 32)  # 16 per process
    assert one["global_step"] == two["global_step"] == 1
    assert two["metrics"][0]["dapo/generated_groups"] >= 2


@pytest.mark.distributed
def test_the_recomputed_old_policy_and_its_correction_make_the_same_update_on_two_ranks(runs, tiny_model):
    """Each rank recomputes the old policy of its own rows: the update must not depend on the split, and must differ
    from the one against the scripted rollout's logprobs (the same rows, `scripted`)."""
    one, two = (run["recomputed"] for run in runs)
    assert one["rows"] == two["rows"] == runs[0]["scripted"]["rows"]
    assert two["metrics"][0]["rollout_correction/token_fraction"] > 0  # the correction acted
    assert_same_update(one, two, tiny_model)
    against_rollout = runs[0]["scripted"]["parameters"]
    assert max((one["parameters"][k] - p).abs().max().item() for k, p in against_rollout.items()) > 1e-4


@pytest.mark.distributed
def test_several_passes_per_micro_batch_defer_their_gradient_sync_to_the_last(runs, tiny_model):
    """With `padding_free_max_tokens`, each micro-batch runs several passes: every one but the last under deferred
    gradient synchronisation, the last synchronising what all of them accumulated. The ranks' passes hold unequal
    tokens; the update must be the 1-rank run's, and the uncapped run's (one pass per micro-batch)."""
    one, two = (run["recomputed_capped"] for run in runs)
    passes = two["pass_tokens"]  # per rank, per micro-batch, per pass: its loss tokens
    assert all(len(micro_batch) > 1 for rank in passes for micro_batch in rank)
    assert [len(micro_batch) for micro_batch in passes[0]] == [len(micro_batch) for micro_batch in passes[1]]
    assert passes[0] != passes[1]  # the ranks' passes (and micro-batches' last passes) train unequal tokens
    assert one["rows"] == two["rows"] == runs[0]["recomputed"]["rows"]
    assert_same_update(one, two, tiny_model)
    for world in runs:
        assert_same_update(world["recomputed"], world["recomputed_capped"], tiny_model)


@pytest.mark.distributed
def test_a_rank_whose_rounds_find_nothing_informative_trains_the_other_ranks_groups(runs, tiny_model):
    """Only rank 0's share of the first round is informative and later rounds find nothing: the groups found are
    dealt to both ranks, so rank 1 trains rows it did not generate, and the update is the 1-rank run's."""
    one, two = (run["lonely"] for run in runs)
    metrics = two["metrics"][0]
    assert metrics["dapo/gen_batches"] == 2 and metrics["dapo/partial_batch"] == 1.0
    assert metrics["dapo/qualified_groups"] == one["metrics"][0]["dapo/qualified_groups"] >= 1
    assert all(sum(rank_rows) > 0 for rank_rows in two["micro_batch_rows"])
    assert one["rows"] == two["rows"]
    assert_same_update(one, two, tiny_model)


@pytest.mark.distributed
def test_a_checkpoint_saved_and_resumed_on_the_same_ranks_continues_the_run(runs, tiny_model):
    """Two steps straight against the first step's checkpoint resumed for the second: the same last generation batch
    and the same parameters (AdamW: its state comes back too), on 1 and on 2 ranks."""
    for world in runs:
        straight, resumed = world["straight"], world["resumed"]
        assert resumed["global_step"] == straight["global_step"] == 2
        assert 2 * len(resumed["rows"]) == len(straight["rows"])  # the resumed run generated the second batch only
        assert resumed["rows"] == straight["rows"][len(resumed["rows"]) :]
        for name, value in straight["parameters"].items():
            torch.testing.assert_close(resumed["parameters"][name], value, atol=0, rtol=0, msg=name)


@pytest.mark.distributed
def test_the_engine_holds_the_same_weights_on_every_rank_after_each_sync(runs):
    """Each optimizer step's generation synchronises the engine with the training model: on 2 ranks both engines hold
    the same weights after every synchronisation, and the second differs from the first (the step moved them)."""
    for world in runs:
        syncs = world["engine"]["engine_syncs"]  # per rank, per synchronisation
        assert all(len(rank_syncs) == 2 for rank_syncs in syncs)
        for rank_syncs in syncs[1:]:
            for mine, first in zip(rank_syncs, syncs[0], strict=True):
                assert mine.keys() == first.keys()
                assert all(torch.equal(mine[name], first[name]) for name in first)
        before, after = syncs[0]
        assert any(not torch.equal(before[name], after[name]) for name in before)


def streamed_prompts(run: dict) -> list[int]:
    """The dataset index of each accepted group (4 rows each), in acceptance order."""
    return [run["index_of_prompt"][tuple(prompt)] for prompt, _, _ in run["rows"][::4]]


@pytest.mark.distributed
def test_stream_mode_keeps_each_ranks_first_informative_groups_deterministically(runs):
    """Each rank streams its own prompts: its share of the dataloader batch's prompts, then every second prompt of the
    extra stream (seed + 1), and keeps its informative groups in the order they end (pinned lengths: the order they
    were drawn); the batch is rank 0's kept groups then rank 1's. With one rank, the first 4 informative prompts."""
    extra = torch.randperm(40, generator=torch.Generator().manual_seed(1)).tolist()
    for world, run in enumerate(runs, start=1):
        stream = run["stream"]
        assert stream["rows"] == run["stream_again"]["rows"]  # the same seed, the same groups, completions, order
        for name, value in stream["parameters"].items():
            torch.testing.assert_close(run["stream_again"]["parameters"][name], value, atol=0, rtol=0, msg=name)
        firsts = stream["dataloader"][::4]
        informative = [[i for i in firsts[rank::world] + extra[rank::world] if i % 3 == 1] for rank in range(world)]
        accepted = streamed_prompts(stream)
        assert len(accepted) == 4 and all(i % 3 == 1 for i in accepted)
        if world == 1:
            assert accepted == informative[0][:4]
        else:
            assert any(accepted == informative[0][:k] + informative[1][: 4 - k] for k in range(5)), (
                accepted,
                informative,
            )
        metrics = stream["metrics"][0]
        assert metrics["dapo/qualified_groups"] >= 4 and metrics["dapo/partial_batch"] == 0
        assert metrics["dapo/generated_groups"] == metrics["dapo/qualified_groups"] + metrics["dapo/filtered_groups"]


@pytest.mark.distributed
def test_a_scoring_error_on_one_rank_stops_every_rank(tiny_model, tmp_path):
    """Stream mode scores each group on its own rank: a reward function failing on rank 1 must not leave rank 0
    waiting in the ranks' next agreement. Rank 1 raises its error, naming the group; rank 0 says rank 1 failed."""
    launch_worker("stream_failure_worker.py", 2, tiny_model, tmp_path, timeout=300)
    zero, one = (json.loads((tmp_path / f"rank-{rank}.json").read_text()) for rank in (0, 1))
    assert one["type"] == "ValueError" and one["message"].startswith("no reward for prompt")
    assert any("raised on rank 1 scoring the group of prompt [{'role': 'user'" in note for note in one["notes"]), one
    assert zero["type"] == "RuntimeError" and "rank 1 failed scoring a group" in zero["message"], zero


@pytest.mark.distributed
def test_every_rank_can_build_and_load_the_tiny_model(tiny_model, tmp_path):
    """After `DAPOConfig` has set up the process group, transformers writes a model's files on rank 0 only: rank 1's
    own folder had no weights, and a folder shared by both ranks could be read before rank 0 had written it."""
    launch_worker("tiny_model_worker.py", 2, tiny_model, tmp_path)
    ranks = [json.loads((tmp_path / f"rank-{rank}.json").read_text()) for rank in (0, 1)]
    assert all(rank["process_group"] for rank in ranks)
    expected = ranks[0]["own"]
    assert [(rank["own"], rank["shared"]) for rank in ranks] == [(expected, expected)] * 2  # one seeded model


@pytest.mark.distributed
def test_partial_rollouts_carry_and_resume_the_same_rows_on_two_ranks_as_on_one(runs):
    """Greedy rows, 32 decode slots on each rank (the in-flight cap's 12 groups and a batch's 4 prompts, which enter
    whatever the cap, decode at once: no row waits, on 1 rank or on 2, so where a row decodes does not change when it
    ends): each round admits the same groups (each on the rank its place in the admission order names), sees each end
    at the same agreement and delivers the same groups in the same order on 2 ranks as on 1, carried rows continuing on
    the rank that holds them; the counts (carried groups and rows, tokens an older policy sampled, ages) summed over
    the ranks are the 1-rank run's. Resumed from the first step's checkpoint (every rank's carried groups gathered into
    it, each rank's handed back), a run trains the straight run's later batches and ends with its parameters."""
    one, two = (run["partial_straight"] for run in runs)
    assert len(one["rows"]) == 3 * 8 and one["rows"] == two["rows"]
    for mine, theirs in zip(one["old_logprobs"], two["old_logprobs"], strict=True):
        torch.testing.assert_close(theirs, mine, atol=1e-5, rtol=0)
    names = ("dapo/carried_groups", "dapo/carried_rows", "dapo/carried_tokens", "dapo/resumed_prefill_tokens",
             "dapo/old_policy_token_share", "dapo/trained_group_age_max")  # fmt: skip
    # a count is absent from a step with no engine call or nothing carried: zero
    counts = [[entry.get(name, 0) for name in names] for entry in one["metrics"]]
    assert counts == [[entry.get(name, 0) for name in names] for entry in two["metrics"]]
    assert all(entry["dapo/carried_rows"] > 0 for entry in two["metrics"])
    assert two["metrics"][-1]["dapo/old_policy_token_share"] > 0
    for world in runs:
        straight, resumed = world["partial_straight"], world["partial_resumed"]
        assert resumed["global_step"] == 3 and resumed["rows"] == straight["rows"][8:]
        for name, value in straight["parameters"].items():
            torch.testing.assert_close(resumed["parameters"][name], value, atol=0, rtol=0, msg=name)


@pytest.mark.distributed
def test_each_rank_keeps_the_kv_of_the_rows_it_carries(runs):
    """`partial_straight` keeping its carried rows' KV: each rank keeps and continues from its own rows' KV (older
    weights' KV, so the rows' later logprobs differ from the prefilled run's), and 2 ranks train the rows and logprobs
    1 rank does, with every carried row continued from its kept KV on both (none prefilled again)."""
    one, two = (run["partial_kept"] for run in runs)
    assert len(one["rows"]) == 3 * 8 and one["rows"] == two["rows"]
    for mine, theirs in zip(one["old_logprobs"], two["old_logprobs"], strict=True):
        torch.testing.assert_close(theirs, mine, atol=1e-5, rtol=0)
    kept = [[entry.get("dapo/carried_rows_kept_cache", 0) for entry in run["metrics"]] for run in (one, two)]
    assert kept[0] == kept[1] and sum(kept[0]) > 0
    assert not any(entry.get("dapo/carried_rows_reprefilled") for run in (one, two) for entry in run["metrics"])
    pairs = zip(one["old_logprobs"], runs[0]["partial_straight"]["old_logprobs"], strict=True)
    assert any(ours.shape != theirs.shape or not torch.allclose(ours, theirs, atol=1e-4) for ours, theirs in pairs)
