"""Group filter, the dynamic-sampling buffer, round sizing and the prompt stream, on hand-built batches."""

import io
import math

import numpy as np
import pytest
import torch
from datasets import Dataset

from trl_dapo.rewards import soft_overlong_penalty
from trl_dapo.rollout_batch import concat_rollouts, select_rows, trim_padding
from trl_dapo.sampling import (
    DynamicSamplingBuffer,
    DynamicSamplingLimitError,
    SamplingStats,
    filter_groups,
    group_outcomes,
    make_prompt_stream,
    plan_round_groups,
    solve_rate,
)

G = 2


def test_filter_keeps_groups_whose_metric_varies():
    values = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, -1.0, 1.0, 0.5, math.nan, math.nan, math.nan])
    assert filter_groups(values, 2).tolist() == [False, True, False, True, False, False]
    assert group_outcomes(values, 2, filter_groups) == {"qualified": 2, "all_correct": 2, "all_wrong": 2}
    assert solve_rate(values, 2) == pytest.approx(4 / 6)


def test_filter_rejects_a_ragged_metric():
    with pytest.raises(ValueError, match="groups of 4"):
        filter_groups(torch.zeros(6), 4)


def make_batch(group_ids: list[int], completion_len: int = 3) -> dict:
    """G rows per group; the group id is written into the completion so tests can follow groups around."""
    rows = [g for g in group_ids for _ in range(G)]
    n = len(rows)
    return {
        "prompt_ids": torch.tensor([[0, 10 + g] for g in rows]),
        "prompt_mask": torch.tensor([[0, 1]] * n),
        "completion_ids": torch.tensor([[g] * completion_len for g in rows]),
        "completion_mask": torch.ones(n, completion_len, dtype=torch.long),
        "old_per_token_logps": torch.full((n, completion_len), -1.0),
        "advantages": torch.tensor([1.0, -1.0] * len(group_ids)),
    }


def scripted_rounds(rounds: list[tuple[list[int], list[bool]]]):
    """A `generate_round` that plays back (group ids, informative?) per round and records the planned sizes."""
    requested = []

    def generate(groups: int, round_index: int):
        assert round_index == len(requested)
        requested.append(groups)
        groups, informative = rounds[len(requested) - 1]
        metric = torch.tensor([v for keep in informative for v in ((1.0, 0.0) if keep else (1.0, 1.0))])
        return make_batch(groups), metric

    return generate, requested


def groups_of(batch) -> list[int]:
    return batch["completion_ids"][::G, 0].tolist()


def new_buffer(**overrides) -> DynamicSamplingBuffer:
    settings = dict(
        num_generations=G, pad_token_id=0, keep_groups=filter_groups, max_num_gen_batches=5, max_surplus_age=1
    )
    settings.update(overrides)
    return DynamicSamplingBuffer(**settings)


def test_first_round_uninformative_then_retry_keeps_order_across_rounds():
    generate, requested = scripted_rounds(
        [([1, 2, 3], [False, False, False]), ([4, 5, 6], [True, False, True]), ([7, 8], [True, True])]
    )
    batch, stats = new_buffer().fill(3, generate, step=0)
    assert groups_of(batch) == [4, 6, 7]
    assert requested == [3, 3, 1]
    assert (stats.gen_batches, stats.generated_groups, stats.qualified_groups) == (3, 8, 4)
    assert (stats.filtered_all_correct, stats.filtered_all_wrong) == (4, 0)
    assert stats.metrics()["dapo/sampling_efficiency"] == pytest.approx(4 / 8)
    assert stats.surplus_groups == 1  # group 8 waits for the next batch


def test_the_group_filter_is_the_one_handed_to_the_buffer():
    """Another filter (here: keep a group only when its metric spans at least 1) decides what the buffer keeps and
    how its groups are counted; its stats add up over rounds and ranks."""

    def spans_one(values: torch.Tensor, num_generations: int) -> torch.Tensor:
        grouped = values.view(-1, num_generations)
        return (grouped.amax(dim=1) - grouped.amin(dim=1)) >= 1.0

    def generate(groups: int, round_index: int):
        metric = torch.tensor([1.0, 0.5, 1.0, 0.0, 1.0, 1.0])  # spans 0.5, 1, 0: only the second is kept
        return make_batch([1, 2, 3]), metric

    batch, stats = new_buffer(keep_groups=spans_one, max_num_gen_batches=1).fill(1, generate, step=0)
    assert groups_of(batch) == [2]
    assert (stats.generated_groups, stats.qualified_groups, stats.filtered_all_correct) == (3, 1, 2)
    assert filter_groups(torch.tensor([1.0, 0.5]), 2).item()  # DAPO's own filter would have kept the first
    total = SamplingStats(generated_groups=2, partial=False)
    total += SamplingStats(generated_groups=3, filtered_tokens=7, partial=True)
    assert (total.generated_groups, total.filtered_tokens, total.partial) == (5, 7, True)


def test_surplus_comes_first_next_time_and_ages_out():
    buffer = new_buffer(max_surplus_age=1)
    generate, _ = scripted_rounds([([1, 2, 3], [True, True, True])])
    buffer.fill(2, generate, step=0)
    assert buffer.num_surplus_groups == 1

    generate, requested = scripted_rounds([([4, 5], [True, True])])
    batch, stats = buffer.fill(2, generate, step=1)
    assert groups_of(batch) == [3, 4]  # surplus group 3 first, its rollout logprobs intact
    assert stats.surplus_used == 1 and requested == [2]  # the first round is the whole dataloader batch
    assert buffer.num_surplus_groups == 1  # group 5, born at step 1

    generate, _ = scripted_rounds([([6, 7], [True, True])])
    batch, stats = buffer.fill(2, generate, step=3)  # group 5 is 2 steps old > max_surplus_age
    assert groups_of(batch) == [6, 7]
    assert stats.discarded_qualified_groups == 1 and stats.surplus_used == 0


def test_token_counts_split_generated_tokens_into_filtered_trained_surplus_and_wasted():
    """3 tokens per row, 2 rows per group. Step 0: groups 1-3 of which 2 is filtered, 1 trained, 3 surplus. Step 2:
    surplus group 3 is too old (wasted), groups 4 and 5 are trained. Without surplus, group 3 is wasted at once."""
    generate, _ = scripted_rounds([([1, 2, 3], [True, False, True])])
    buffer = new_buffer(max_surplus_age=1)
    _, stats = buffer.fill(1, generate, step=0)
    assert (stats.generated_tokens, stats.filtered_tokens, stats.surplus_tokens, stats.untrained_tokens) == (
        18,
        6,
        6,
        0,
    )
    generate, _ = scripted_rounds([([4, 5], [True, True])])
    _, stats = buffer.fill(2, generate, step=2)
    assert (stats.generated_tokens, stats.filtered_tokens, stats.surplus_tokens, stats.untrained_tokens) == (
        12,
        0,
        0,
        6,
    )
    assert stats.metrics()["dapo/untrained_token_share"] == 0.5  # 6 wasted of the 12 generated now
    generate, _ = scripted_rounds([([1, 2, 3], [True, False, True])])
    _, stats = new_buffer(keep_surplus=False).fill(1, generate, step=0)
    assert (stats.surplus_tokens, stats.untrained_tokens) == (0, 6)


def test_surplus_off_discards_and_counts_it():
    generate, _ = scripted_rounds([([1, 2, 3], [True, True, True])])
    buffer = new_buffer(keep_surplus=False)
    _, stats = buffer.fill(1, generate, step=0)
    assert stats.discarded_qualified_groups == 2 and buffer.num_surplus_groups == 0


def test_limit_raises_with_what_was_found():
    generate, _ = scripted_rounds([([1, 2], [True, False]), ([3, 4], [False, False])])
    with pytest.raises(DynamicSamplingLimitError, match=r"2 candidate generation rounds .* found 1 of the 3"):
        new_buffer(max_num_gen_batches=2, on_limit="raise").fill(3, generate, step=0)


def test_limit_can_train_on_partial_in_whole_shareable_groups():
    generate, _ = scripted_rounds([([1, 2, 3], [True, True, True]), ([4, 5], [False, False])])
    buffer = new_buffer(max_num_gen_batches=2, on_limit="train_on_partial")
    batch, stats = buffer.fill(4, generate, step=0, group_multiple=2)
    assert groups_of(batch) == [1, 2] and stats.partial
    assert buffer.num_surplus_groups == 1  # group 3 did not fit the multiple: kept, not dropped


def test_limit_with_nothing_informative_returns_an_empty_batch_to_skip():
    generate, requested = scripted_rounds([([1, 2], [False, False]), ([3, 4], [False, False])])
    batch, stats = new_buffer(max_num_gen_batches=2, on_limit="train_on_partial").fill(2, generate, step=0)
    assert groups_of(batch) == [] and set(batch) == set(make_batch([1]))  # every key, zero rows
    assert stats.partial and requested == [2, 2]


def test_unlimited_rounds():
    rounds = [([i], [False]) for i in range(12)] + [([99], [True])]
    generate, _ = scripted_rounds(rounds)
    batch, stats = new_buffer(max_num_gen_batches=0).fill(1, generate, step=0, dataset_prompts=lambda: 13)
    assert groups_of(batch) == [99] and stats.gen_batches == 13


def test_unlimited_rounds_stop_after_a_full_pass_without_an_informative_group():
    """5 prompts in the training set: the 5th uninformative group in a row ends the search, instead of looping."""
    generate, requested = scripted_rounds([([1, 2], [True, False])] + [([i], [False]) for i in range(3, 20)])
    with pytest.raises(DynamicSamplingLimitError, match="at least 5 groups in a row, as many as train_dataset has"):
        new_buffer(max_num_gen_batches=0).fill(3, generate, step=0, dataset_prompts=lambda: 5)
    assert len(requested) == 6  # round 1 found one; rounds 2-6 found nothing in 5 groups


def test_extra_rounds_are_reported_before_they_run():
    reports = []
    generate, _ = scripted_rounds([([1, 2], [True, False]), ([3], [False]), ([4], [True])])
    new_buffer().fill(2, generate, step=0, report=lambda *args: reports.append(args))
    assert reports == [(1, 1, 1, 2), (2, 1, 1, 2)]  # (round index, groups to generate, found, needed)


def test_buffer_state_round_trips_through_a_weights_only_load():
    buffer = new_buffer()
    generate, _ = scripted_rounds([([1, 2, 3], [True, True, False])])
    buffer.fill(1, generate, step=4)
    saved = io.BytesIO()
    torch.save(buffer.state_dict(), saved)
    saved.seek(0)
    restored = new_buffer()
    restored.load_state_dict(torch.load(saved, weights_only=True), device="cpu")
    assert restored.num_surplus_groups == 1 and restored.surplus_birth.tolist() == [4]
    assert groups_of(restored.surplus) == [2]
    assert restored.efficiency == buffer.efficiency


def test_running_efficiency_is_a_decayed_ratio_with_no_prior():
    """Round 1: 1 of 4 groups qualifies; round 2: 2 of 2. Efficiency = decayed qualified / decayed generated."""
    buffer = new_buffer()
    assert buffer.efficiency == 1.0
    generate, _ = scripted_rounds([([1, 2, 3, 4], [True, False, False, False]), ([5, 6], [True, True])])
    buffer.fill(3, generate, step=0)
    assert buffer.efficiency == pytest.approx((0.5 * 1 + 2) / (0.5 * 4 + 2))  # 0.625

    first_only = new_buffer()
    generate, _ = scripted_rounds([([1, 2, 3, 4], [True, False, False, False])])
    first_only.fill(1, generate, step=0)
    assert first_only.efficiency == pytest.approx(1 / 4)  # the first round sets it: no pull towards a prior of 1


@pytest.mark.parametrize(
    ("missing", "efficiency", "oversample", "minimum", "expected"),
    [
        (4, 1.0, "1.0", 0, 4),
        (4, 0.5, "1.0", 0, 4),  # fixed factor ignores the efficiency
        (4, 0.5, "2.0", 0, 8),
        (4, 0.5, "auto", 0, 10),  # 4 / 0.5 * 1.25
        (4, 0.01, "auto", 0, 32),  # capped
        (1, 1.0, "1.0", 8, 8),  # the dataloader's batch is generated whole
        (3, 1.0, "1.0", 0, 4),  # rounded up to the multiple
    ],
)
def test_round_sizing(missing, efficiency, oversample, minimum, expected):
    assert plan_round_groups(missing, efficiency, oversample, cap=32, multiple=2, minimum=minimum) == expected


def numbered(count: int) -> Dataset:
    return Dataset.from_dict({"prompt": [f"p{i}" for i in range(count)], "i": list(range(count))})


@pytest.mark.parametrize("streaming", [False, True], ids=["map-style", "streaming"])
def test_prompt_stream_covers_each_epoch_and_resumes(streaming):
    dataset = numbered(5).to_iterable_dataset() if streaming else numbered(5)
    stream = make_prompt_stream(dataset, seed=3, shuffle=True)
    first = [row["i"] for row in stream.take(5)]
    assert sorted(first) == [0, 1, 2, 3, 4] and stream.num_prompts == (None if streaming else 5)
    state = stream.state_dict()
    following = [row["i"] for row in stream.take(7)]
    assert sorted(following[:5]) == [0, 1, 2, 3, 4] and following[:5] != first  # a new epoch, a new order
    assert stream.num_prompts == 5  # a stream knows its size once a pass has ended
    saved = io.BytesIO()
    torch.save(state, saved)
    saved.seek(0)
    again = make_prompt_stream(dataset, seed=3, shuffle=True)
    again.load_state_dict(torch.load(saved, weights_only=True))
    assert [row["i"] for row in again.take(7)] == following


def test_concat_repads_and_trim_drops_padding_columns():
    short = make_batch([1], completion_len=2)
    long = make_batch([2], completion_len=4)
    long["prompt_ids"] = torch.tensor([[7, 8, 12]] * G)
    long["prompt_mask"] = torch.ones(G, 3, dtype=torch.long)
    both = concat_rollouts([short, long], pad_token_id=0)
    assert both["completion_ids"].shape == (4, 4) and both["prompt_ids"].shape == (4, 3)
    assert both["completion_mask"][:2].tolist() == [[1, 1, 0, 0]] * 2
    assert both["prompt_mask"][:2].tolist() == [[0, 0, 1]] * 2  # left padding grows on the left
    whole, head = trim_padding([both, select_rows(both, slice(0, 2))])  # each trimmed to its own used columns
    assert whole["completion_ids"].shape == (4, 4) and whole["prompt_ids"].shape == (4, 3)
    assert head["completion_ids"].tolist() == short["completion_ids"].tolist()
    assert head["prompt_ids"].tolist() == [[11]] * G


@pytest.mark.parametrize(
    ("length", "expected"),
    [(0, 0.0), (16, 0.0), (17, -0.25), (18, -0.5), (20, -1.0), (25, -1.0)],
)
def test_soft_overlong_penalty_at_the_boundaries(length, expected):
    # max 20, buffer 4: free up to 16 = max - buffer, then -1/4 per token, -1 from 20 on
    penalty = soft_overlong_penalty(torch.tensor([length]), max_completion_length=20, buffer_len=4, penalty_factor=1.0)
    assert penalty.item() == pytest.approx(expected)


def test_soft_overlong_penalty_factor_and_off_switch():
    lengths = torch.tensor([18])
    assert soft_overlong_penalty(lengths, 20, 4, penalty_factor=0.5).item() == pytest.approx(-0.25)
    assert soft_overlong_penalty(lengths, 20, 0).item() == 0.0


def test_soft_overlong_penalty_takes_any_sequence_of_lengths():
    expected = [0.0, -0.25, -1.0]
    for lengths in ([16, 17, 21], (16, 17, 21), np.array([16, 17, 21]), torch.tensor([16, 17, 21])):
        penalty = soft_overlong_penalty(lengths, max_completion_length=20, buffer_len=4)
        assert penalty.dtype == torch.float32 and penalty.tolist() == expected
    assert soft_overlong_penalty([16, 17, 21], 20, 0).tolist() == [0.0, 0.0, 0.0]
    for wrong in (["16"], None, [True, False]):
        with pytest.raises(TypeError, match=r"completion_lengths must be token counts .* \[len\(ids\) for ids in"):
            soft_overlong_penalty(wrong, 20, 4)
