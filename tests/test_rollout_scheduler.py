"""The continuous-batching schedule on its own: page accounting, prefix sharing, admission limits, preemption order,
and that every row completes whatever the pool size."""

import numpy as np
import pytest

from trl_dapo.rollout.scheduler import PagePool, Scheduler


def drive(scheduler: Scheduler, lengths: list[int], max_steps: int = 10_000) -> dict:
    """Run the schedule as the engine does, with rows that stop after `lengths[row]` tokens; return what happened.

    Stands in for the device: each decode step adds one token to every running row that has not reached its length.
    """
    generated_tokens = {row: [] for row in range(len(lengths))}
    admitted, preempted, peak_pages, first_preemption = [], [], 0, None
    active = {}
    for _ in range(max_steps):
        running_before = list(scheduler.running)
        victims = scheduler.reserve()
        if victims and first_preemption is None:
            first_preemption = (running_before, victims)
        for row in victims:
            preempted.append(row)
            scheduler.requeue(row, generated_tokens[row][: scheduler.generated[row]])
            active.pop(row, None)
        admission = scheduler.admit()
        scheduler.complete(admission)
        for row in admission.rows:
            admitted.append(row)
            scheduler.generated[row] += 1
            generated_tokens[row] = [*generated_tokens[row][: scheduler.generated[row] - 1], row]
            active[row] = scheduler.generated[row] < lengths[row]
        peak_pages = max(peak_pages, scheduler.pool.num_pages - scheduler.pool.free)
        if scheduler.done:
            break
        running = list(scheduler.running)
        counts = scheduler.generated[running].copy()
        for _ in range(scheduler.steps):
            for slot, row in enumerate(running):
                if active[row]:
                    counts[slot] += 1
                    generated_tokens[row].append(row)
                    active[row] = counts[slot] < lengths[row]
        scheduler.retire(counts, np.array([active[row] for row in running]))
    return {
        "admitted": admitted,
        "preempted": preempted,
        "first_preemption": first_preemption,
        "peak_pages": peak_pages,
        "tokens": generated_tokens,
    }


def test_page_pool_frees_a_page_when_its_last_holder_releases_it():
    pool = PagePool(4)
    pages = pool.allocate(2)
    pool.share(pages[:1])
    pool.release(pages)
    assert pool.free == 3  # the shared page is still held once
    pool.release(pages[:1])
    assert pool.free == 4
    with pytest.raises(RuntimeError, match="5 pages asked for, 4 free"):
        pool.allocate(5)


def test_rows_of_one_prompt_share_its_full_pages_and_copy_the_partial_one():
    # prompt of 10 tokens, pages of 4: two full pages shared, the third (2 tokens) copied per row
    scheduler = Scheduler([[5] * 10] * 3, max_new_tokens=4, page_size=4, num_pages=64, max_rows=8, steps=2)
    admission = scheduler.admit()
    assert [len(p.tokens) for p in admission.prefill] == [10]  # prefilled once for the three rows
    prompt_pages = admission.prefill[0].pages
    assert len(prompt_pages) == 3
    assert [source for source, _ in admission.copies] == [prompt_pages[2]] * 3
    for row in range(3):
        assert scheduler.page_table[row, :2].tolist() == prompt_pages[:2]
        # next tokens fed at positions 10 and 11: still the copied third page
        assert scheduler.page_count[row] == 3 and scheduler.page_table[row, 2] != prompt_pages[2]
    # the prompt's own hold on its pages ends once the device has copied its partial page (not before: a page freed
    # now could be handed out and overwritten by this admission's prefill before the copy reads it)
    assert scheduler.pool.references[prompt_pages].tolist() == [4, 4, 1]
    scheduler.complete(admission)
    assert scheduler.pool.references[prompt_pages].tolist() == [3, 3, 0]
    assert admission.released_prefixes == [admission.prefill[0].index]


def test_admission_stops_at_the_slot_limit_and_refills_as_rows_finish():
    prompts = [[row] * 3 for row in range(10)]
    scheduler = Scheduler(prompts, max_new_tokens=5, page_size=4, num_pages=200, max_rows=4, steps=3)
    result = drive(scheduler, lengths=[1 + row % 5 for row in range(10)])
    assert result["admitted"] == list(range(10)) and not result["preempted"]
    assert scheduler.done and scheduler.pool.free == 200  # every page came back
    assert scheduler.generated.tolist() == [1 + row % 5 for row in range(10)]


def test_a_short_pool_preempts_the_latest_rows_and_still_completes_every_row():
    prompts = [[row] * 6 for row in range(6)]
    lengths = [20] * 6
    # each row needs ceil((6 + 20) / 4) = 7 pages at the end; 16 pages hold two such rows, not six
    scheduler = Scheduler(prompts, max_new_tokens=20, page_size=4, num_pages=16, max_rows=6, steps=4)
    result = drive(scheduler, lengths)
    assert result["preempted"], "a pool of 16 pages must preempt"
    assert result["peak_pages"] <= 16
    assert scheduler.done and scheduler.pool.free == 16
    assert scheduler.generated.tolist() == lengths
    # a preempted row resumes with its own tokens so far: its prefix is its prompt plus what it generated
    assert all(tokens == [row] * 20 for row, tokens in result["tokens"].items())
    # the most recently admitted rows go, most recent first
    running, victims = result["first_preemption"]
    assert victims == running[::-1][: len(victims)]


def test_requeued_rows_resume_from_their_own_tokens_in_admission_order():
    scheduler = Scheduler(
        [[1] * 4, [2] * 4, [3] * 4], max_new_tokens=8, page_size=4, num_pages=64, max_rows=3, steps=1
    )
    scheduler.admit()
    scheduler.generated[:] = 3
    for row in (2, 1):  # the order `reserve` hands victims back: most recent first
        scheduler._free_row(row)
        scheduler.running.remove(row)
        scheduler.requeue(row, [row + 10] * 3)
    assert list(scheduler.waiting) == [1, 2]
    admission = scheduler.admit()
    assert [p.tokens for p in admission.prefill] == [[2] * 4 + [11] * 3, [3] * 4 + [12] * 3]
    # a resumed row owns its recomputed pages: 7 tokens in pages of 4 are 2 pages, and the token sampled now is fed
    # at position 7, still in the second page
    assert scheduler.page_count[1] == 2 and scheduler.page_table[1, :2].tolist() == admission.prefill[0].pages


def test_a_pool_that_cannot_hold_one_row_is_rejected_up_front_naming_the_row():
    """8 pages of 16 tokens, one kept back (the admission watermark): 112 tokens for a row, so at most 12 prompt tokens
    beside 100 new ones; the row that cannot fit is named, at its place in the call, here and when rows are added."""
    with pytest.raises(ValueError, match=r"row 1 of this call: 30 prompt \+ 100 new tokens.*max_prompt_length=12"):
        Scheduler([[1] * 5, [1] * 30], max_new_tokens=100, page_size=16, num_pages=8, max_rows=4, steps=8)
    scheduler = Scheduler([[1] * 5], max_new_tokens=100, page_size=16, num_pages=8, max_rows=4, steps=8)
    with pytest.raises(ValueError, match=r"row 3 of this call: 40 prompt \+ 100 new tokens.*max_prompt_length=12"):
        scheduler.add_rows([[2] * 3, [2] * 3, [2] * 40])
