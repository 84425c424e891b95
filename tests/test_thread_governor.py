"""The thread governor (specee/model/thread_governor.py): passes run on fewer threads while that is
clearly faster (another process on a core), on all of them otherwise, and the bits never change."""
import pytest
import torch

from helpers import threads
from specee.model.passes import PassRows
from specee.model.thread_governor import (BASELINE_PASSES, EARLY_PASSES, FIRST_WAIT, LONGEST_WAIT, MOST_ROWS,
                                          PROBE_PASSES, TRIGGER_GAP, ThreadGovernor)


def drive(governor: ThreadGovernor, seconds_on, passes: int, rows: int = 1) -> list[int]:
    """`passes` passes, each taking seconds_on(threads) on the count the governor runs; the counts run."""
    ran = []
    for _ in range(passes):
        ran.append(governor.running)
        governor.record(rows, seconds_on(governor.running))
    return ran


def quiet(threads: int) -> float:  # every thread helps: two run 1.85x as fast as one
    return 0.010 / min(threads, 2) ** 0.89


def busy(threads: int) -> float:  # another process holds one of two cores: two threads wait at barriers
    return 0.010 if threads == 1 else 0.018


def test_a_quiet_machine_keeps_every_thread_and_probes_ever_more_rarely():
    """One thread of two is slower at once: each probe ends after its first passes."""
    governor = ThreadGovernor(2, 0.15)
    ran = drive(governor, quiet, 7 * FIRST_WAIT + 3 * EARLY_PASSES + 1)
    probes = [i for i, count in enumerate(ran) if count == 1 and (i == 0 or ran[i - 1] == 2)]
    assert governor.count == 2 and sum(count == 1 for count in ran) == EARLY_PASSES * len(probes)
    gaps = [b - a - EARLY_PASSES for a, b in zip(probes, probes[1:])]
    assert len(probes) == 3 and probes[0] == FIRST_WAIT and gaps == [2 * FIRST_WAIT, 4 * FIRST_WAIT]
    drive(governor, quiet, 40 * LONGEST_WAIT)
    assert governor.wait == LONGEST_WAIT and governor.count == 2


def test_a_busy_core_is_given_up_and_taken_back_when_it_frees():
    governor = ThreadGovernor(2, 0.15)
    drive(governor, busy, FIRST_WAIT + PROBE_PASSES)
    assert governor.count == 1  # one thread was clearly faster
    drive(governor, busy, 10 * FIRST_WAIT)
    assert governor.count == 1  # probes of two threads keep losing
    drive(governor, quiet, 2 * LONGEST_WAIT)
    assert governor.count == 2  # the core is free again


def test_many_cores_give_up_one_thread_at_a_time():
    def one_busy(count: int) -> float:  # 16 cores, one held: 15 threads or fewer run unhindered
        return 0.004 * 16 / count * (2.0 if count == 16 else 1.0)
    governor = ThreadGovernor(16, 0.15)
    drive(governor, one_busy, FIRST_WAIT + PROBE_PASSES)
    assert governor.count == 15
    drive(governor, one_busy, 20 * FIRST_WAIT)
    assert governor.count == 15  # 14 is slower, 16 is slower


def test_passes_that_slow_down_probe_at_once():
    governor = ThreadGovernor(2, 0.15)
    drive(governor, quiet, FIRST_WAIT + EARLY_PASSES + TRIGGER_GAP)  # the first probe lost; the next far off
    assert governor.count == 2 and governor.until_probe == 2 * FIRST_WAIT - TRIGGER_GAP > BASELINE_PASSES + PROBE_PASSES
    ran = drive(governor, busy, BASELINE_PASSES + PROBE_PASSES)
    assert 1 in ran and governor.count == 1


def test_prefill_chunks_and_row_counts_are_set_side_by_side():
    governor = ThreadGovernor(2, 0.15)
    drive(governor, lambda threads: 5.0, 3 * FIRST_WAIT, rows=MOST_ROWS + 1)  # not timed
    assert governor.until_probe == FIRST_WAIT and not governor.recent
    # One-row passes, then passes of 5 rows taking 1.6x as long: priced per one-row pass, the same,
    # so no slowdown is seen (where one would probe at once: the periodic probe put off).
    governor.until_probe = LONGEST_WAIT
    for i in range(BASELINE_PASSES + 2 * TRIGGER_GAP):
        rows = 1 if i < BASELINE_PASSES else 5
        governor.record(rows, 0.010 * (1 + 0.15 * (rows - 1)))
    assert governor.trying is None and governor.settled == pytest.approx(0.010)


def test_a_pass_runs_on_the_governed_count_and_leaves_the_callers_own_count_alone():
    seen = []
    governor = ThreadGovernor(2, 0.15)
    governor.count = 1
    with threads(2):
        with governor.timed(1):
            seen.append(torch.get_num_threads())
        seen.append(torch.get_num_threads())  # kept for the work between passes
        governor.count = 2
        with governor.timed(1):
            seen.append(torch.get_num_threads())
    with threads(3):  # the caller's own count: not one the governor set, so not governed
        with governor.timed(1):
            seen.append(torch.get_num_threads())
    assert seen == [1, 1, 2, 3] and len(governor.recent) == 2


def test_passes_on_any_thread_count_give_the_same_logits():
    """A generation's passes switch between two threads and one: every token's logits are those of
    passes on one thread (each matmul tile and attention item is one thread's work)."""
    from test_batch_invariance import kernel_model

    model = kernel_model("int4")
    ids = [3, 17, 42, 5, 99, 7, 61, 12]

    def decode(governor):
        model.thread_governor = governor
        cache, out, tokens = model.new_cache(64), [], list(ids)
        with torch.inference_mode():
            logits = model.run_pass(PassRows(torch.tensor(tokens), torch.arange(len(tokens)), cache))[1][-1]
            for step in range(12):
                out.append(logits)
                tokens.append(int(logits.argmax()))
                rows = [tokens[-1]] + ([1, 2] if step % 3 == 0 else [])  # now and then a pass of three rows
                positions = torch.arange(len(tokens) - 1, len(tokens) - 1 + len(rows))
                logits = model.run_pass(PassRows(torch.tensor(rows), positions, cache))[1][0]
                cache.truncate(len(tokens))
        return torch.stack(out)

    with threads(1):
        alone = decode(None)
    switching = ThreadGovernor(2, 0.15)
    counts = []
    switching.record = lambda rows, seconds: (counts.append(switching.running),  # noqa: E731
                                              setattr(switching, "count", 3 - switching.count))
    with threads(2):
        switched = decode(switching)
    assert set(counts) == {1, 2} and torch.equal(alone, switched)


def test_a_step_costs_its_pass_and_the_work_since_the_last_one_but_not_a_pause(monkeypatch):
    import specee.model.thread_governor as module

    clock = iter([0.0, 0.010, 0.012, 0.022, 1.0, 1.010])  # (start, end) of three passes of 10 ms
    monkeypatch.setattr(module.time, "perf_counter", lambda: next(clock))
    governor = ThreadGovernor(2, 0.15)
    with threads(2):
        for _ in range(3):
            with governor.timed(1):
                pass
    # 2 ms of work between the first two passes count; a pause of 978 ms (no request) does not.
    assert list(governor.recent) == pytest.approx([0.010, 0.012, 0.010])
