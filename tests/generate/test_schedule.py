"""The pipeline schedule as data (tests/helpers/pipeline_schedule.py), with no MPI: micro-batch splits, the order of
(stage, micro-batch, token step) work items, bubbles counted by hand, early stopping and hybrid regrouping.

Conventions of `simulate` used below: one time unit per (stage, work item); a work item computed by the last
stage at time t is back at stage 0 at time t + 1. new_tokens[seq] counts every token a sequence generates, the
first one coming out of the prompt phase, so a sequence with n tokens is in gen steps 1 .. n - 1.
"""

from __future__ import annotations

from collections import defaultdict

import pytest

from pipeline_schedule import Event, bubble_fraction, gen_ready_order, simulate
from hpcinfer.parallel.micro_batches import micro_batches


# ------------------------------------------------------------------------------------------------ helpers

def play(stages, n_seqs, prompt_mb, gen_mb, tokens):
    """simulate() on n_seqs sequences; tokens is an int (the same for all) or a list, one count per sequence."""
    new_tokens = {s: (tokens if isinstance(tokens, int) else tokens[s]) for s in range(n_seqs)}
    prompt_groups, gen_groups = micro_batches(n_seqs, prompt_mb), micro_batches(n_seqs, gen_mb)
    return prompt_groups, gen_groups, new_tokens, simulate(stages, prompt_groups, gen_groups, new_tokens)


def item(e: Event) -> tuple:
    return e.phase, e.micro_batch, e.token_step


def by_stage(events, stages) -> list[list[Event]]:
    rows = [[] for _ in range(stages)]
    for e in sorted(events, key=lambda e: e.time):
        rows[e.stage].append(e)
    return rows


def timeline(events, stage) -> list:
    """One entry per time unit over the whole span: the work item the stage runs, or None (a bubble)."""
    span = max(e.time for e in events) + 1
    row = [None] * span
    for e in events:
        if e.stage == stage:
            row[e.time] = item(e)
    return row


def bubbles(events, stages) -> int:
    span = max(e.time for e in events) + 1
    return span * stages - len(events)


# (stages, sequences, prompt micro-batches, gen micro-batches, tokens per sequence)
CASES = {
    "P1-M1": (1, 3, 1, 1, 4),
    "P2-M2-equal": (2, 4, 2, 2, 3),
    "P2-M1": (2, 3, 1, 1, 5),
    "P2-M4-mixed": (2, 8, 4, 4, [2, 5, 1, 3, 6, 6, 2, 4]),
    "P3-M3-equal": (3, 6, 3, 3, 4),
    "P3-M2": (3, 4, 2, 2, [3, 1, 4, 2]),
    "P4-M6-mixed": (4, 11, 6, 6, [1, 2, 3, 4, 5, 6, 7, 1, 3, 5, 7]),
    "P2-hybrid-4-1": (2, 8, 4, 1, 4),
    "P2-hybrid-1-4": (2, 8, 1, 4, [4, 2, 5, 3, 4, 2, 5, 3]),
    "P3-hybrid-3-2": (3, 8, 3, 2, [3, 6, 2, 5, 4, 1, 6, 3]),
    "P4-hybrid-2-5": (4, 9, 2, 5, [2, 3, 4, 5, 6, 2, 3, 4, 5]),
    "P2-all-stop-at-prompt": (2, 4, 2, 2, 1),
    "P2-one-mb-stops-at-prompt": (2, 4, 2, 2, [1, 1, 3, 4]),
}


@pytest.fixture(params=CASES.values(), ids=CASES.keys())
def case(request):
    stages, n_seqs, prompt_mb, gen_mb, tokens = request.param
    prompt_groups, gen_groups, new_tokens, events = play(stages, n_seqs, prompt_mb, gen_mb, tokens)
    return stages, prompt_groups, gen_groups, new_tokens, events


# ------------------------------------------------------------------------------------------- micro_batches

@pytest.mark.parametrize("n", range(1, 13))
@pytest.mark.parametrize("count", range(1, 16))
def test_micro_batches_are_contiguous_balanced_and_cover_all(n, count):
    groups = micro_batches(n, count)
    assert len(groups) == min(count, n)                                  # never an empty micro-batch
    assert [s for g in groups for s in g] == list(range(n))              # contiguous, in order, each once
    sizes = [len(g) for g in groups]
    assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1
    assert all(isinstance(g, range) and g.step == 1 for g in groups)


def test_micro_batches_by_hand():
    assert micro_batches(8, 3) == [range(0, 3), range(3, 6), range(6, 8)]
    assert micro_batches(5, 2) == [range(0, 3), range(3, 5)]
    assert micro_batches(4, 4) == [range(0, 1), range(1, 2), range(2, 3), range(3, 4)]
    assert micro_batches(3, 8) == [range(0, 1), range(1, 2), range(2, 3)]     # capped at the sequences
    assert micro_batches(7, 1) == [range(0, 7)]


# -------------------------------------------------------------------------------- properties of every case

def test_every_stage_sees_the_same_items_in_the_same_order(case):
    """(a) FIFO through the pipeline: same (phase, micro-batch, token step) sequence, same sequences, every stage."""
    stages, _, _, _, events = case
    rows = by_stage(events, stages)
    first = [(item(e), e.sequences) for e in rows[0]]
    for s in range(1, stages):
        assert [(item(e), e.sequences) for e in rows[s]] == first, f"stage {s} differs from stage 0"
    assert len(set(item(e) for e in rows[0])) == len(rows[0])           # each work item once per stage
    assert events == sorted(events, key=lambda e: (e.time, e.stage))


def test_prompt_phase_first_then_generation(case):
    stages, prompt_groups, _, _, events = case
    order = [item(e) for e in by_stage(events, stages)[0]]
    assert order[:len(prompt_groups)] == [("prompt", p, 0) for p in range(len(prompt_groups))]
    assert all(phase == "gen" for phase, _, _ in order[len(prompt_groups):])


def test_no_item_before_its_input_exists(case):
    """(b) stage s computes an item strictly after stage s-1 did; gen step k of a micro-batch enters stage 0
    strictly after step k-1 left the last stage (step 1: after every prompt micro-batch holding its sequences)."""
    stages, prompt_groups, gen_groups, _, events = case
    at = {(item(e), e.stage): e.time for e in events}
    for (it, stage), t in at.items():
        if stage > 0:
            assert t > at[(it, stage - 1)], (it, stage)
    last = stages - 1
    prompt_of = {seq: p for p, group in enumerate(prompt_groups) for seq in group}
    for e in events:
        if e.phase != "gen" or e.stage != 0:
            continue
        if e.token_step == 1:
            inputs = {("prompt", prompt_of[seq], 0) for seq in gen_groups[e.micro_batch]}
        else:
            inputs = {("gen", e.micro_batch, e.token_step - 1)}
        for needed in inputs:
            assert e.time > at[(needed, last)], (item(e), needed)


def test_a_stage_runs_one_item_per_time_unit(case):
    """(c)"""
    _, _, _, _, events = case
    slots = [(e.stage, e.time) for e in events]
    assert len(slots) == len(set(slots))
    assert min(e.time for e in events) == 0


def test_each_step_carries_exactly_the_running_sequences(case):
    """(f) gen step k of a micro-batch carries the sequences of it that still need a token; one that stopped is
    in no later step, and a micro-batch with no running sequence has no more steps."""
    stages, prompt_groups, gen_groups, new_tokens, events = case
    stage0 = [e for e in events if e.stage == 0]
    for e in stage0:
        if e.phase == "prompt":
            assert e.sequences == tuple(prompt_groups[e.micro_batch])
        else:
            expected = tuple(s for s in gen_groups[e.micro_batch] if new_tokens[s] > e.token_step)
            assert e.sequences == expected and expected, item(e)
    steps = defaultdict(list)
    for e in stage0:
        if e.phase == "gen":
            steps[e.micro_batch].append(e.token_step)
    for g, group in enumerate(gen_groups):
        assert steps[g] == list(range(1, max(new_tokens[s] for s in group)))
    # every token of every sequence is accounted for: 1 from the prompt phase + one per gen step it is in
    passes = defaultdict(int)
    for e in stage0:
        for seq in e.sequences:
            passes[seq] += 1
    assert dict(passes) == new_tokens


def test_stage_0_never_idles_while_a_micro_batch_is_ready(case):
    """(f) no stall: whenever stage 0 is idle inside the schedule, every micro-batch it runs later is still in
    flight (its previous step has not left the last stage), so finished micro-batches cost no time."""
    stages, prompt_groups, gen_groups, _, events = case
    last = stages - 1
    at = {(item(e), e.stage): e.time for e in events}
    prompt_of = {seq: p for p, group in enumerate(prompt_groups) for seq in group}

    def ready(e):                                                      # when its input is back at stage 0
        if e.token_step == 1:
            return max(at[(("prompt", prompt_of[s], 0), last)] for s in gen_groups[e.micro_batch]) + 1
        return at[(("gen", e.micro_batch, e.token_step - 1), last)] + 1

    row = timeline(events, 0)
    later_gen = [e for e in events if e.stage == 0 and e.phase == "gen"]
    end = max(e.time for e in events if e.stage == 0)
    for t in range(end):
        if row[t] is None:
            waiting = [item(e) for e in later_gen if e.time > t and ready(e) <= t]
            assert not waiting, f"stage 0 idle at {t} while {waiting} were ready"


def test_bubble_fraction_counts_idle_units(case):
    stages, _, _, _, events = case
    span = max(e.time for e in events) + 1
    assert bubble_fraction(events, stages) == pytest.approx(bubbles(events, stages) / (span * stages))
    assert 0.0 <= bubble_fraction(events, stages) < 1.0


# ---------------------------------------------------------------------------------------- counted by hand

def test_two_stages_two_micro_batches_by_hand():
    """(d) P=2, 4 sequences, prompt micro-batches {0,1} {2,3}, gen micro-batches the same, 3 tokens each.

        t:        0    1    2    3    4    5    6
        stage 0:  p0   p1   g0.1 g1.1 g0.2 g1.2  .
        stage 1:  .    p0   p1   g0.1 g1.1 g0.2 g1.2

    p0 leaves stage 1 at t=1, so g0.1 (gen micro-batch 0, step 1) enters stage 0 at t=2, right behind p1;
    g0.1 leaves stage 1 at t=3, so g0.2 enters at t=4, and so on. 12 work units over 7 x 2 stage-units:
    2 bubbles (the fill at stage 1, t=0; the drain at stage 0, t=6), bubble fraction 2/14 = 1/7."""
    _, _, _, events = play(2, 4, 2, 2, 3)
    assert timeline(events, 0) == [("prompt", 0, 0), ("prompt", 1, 0), ("gen", 0, 1), ("gen", 1, 1),
                                   ("gen", 0, 2), ("gen", 1, 2), None]
    assert timeline(events, 1) == [None, ("prompt", 0, 0), ("prompt", 1, 0), ("gen", 0, 1), ("gen", 1, 1),
                                   ("gen", 0, 2), ("gen", 1, 2)]
    assert bubbles(events, 2) == 2
    assert bubble_fraction(events, 2) == pytest.approx(1 / 7)


def test_three_stages_two_micro_batches_by_hand():
    """(d) P=3 with only 2 micro-batches (1 sequence each, 2 tokens: the prompt pass and 1 gen step).

        t:        0    1    2    3    4    5    6
        stage 0:  p0   p1   .    g0.1 g1.1 .    .
        stage 1:  .    p0   p1   .    g0.1 g1.1 .
        stage 2:  .    .    p0   p1   .    g0.1 g1.1

    p0 leaves stage 2 at t=2, so g0.1 cannot enter before t=3: with M < P the pipeline drains at every token step.
    12 work units over 7 x 3: 9 bubbles, 3 on each stage."""
    _, _, _, events = play(3, 2, 2, 2, 2)
    assert timeline(events, 0) == [("prompt", 0, 0), ("prompt", 1, 0), None, ("gen", 0, 1), ("gen", 1, 1),
                                   None, None]
    assert timeline(events, 2) == [None, None, ("prompt", 0, 0), ("prompt", 1, 0), None, ("gen", 0, 1),
                                   ("gen", 1, 1)]
    assert bubbles(events, 3) == 9
    assert bubble_fraction(events, 3) == pytest.approx(9 / 21)


# ------------------------------------------------------------------------------------------- steady state

@pytest.mark.parametrize("stages, micro, tokens", [(2, 2, 3), (2, 2, 9), (2, 3, 5), (3, 3, 4), (3, 5, 6),
                                                   (4, 4, 3), (4, 6, 7), (4, 8, 2)])
def test_enough_micro_batches_keep_the_pipeline_full(stages, micro, tokens):
    """(e) M >= P micro-batches of equal length: stage 0 is busy every unit from the first to its last item,
    and the whole schedule pays P*(P-1) bubbles (fill + drain) once, whatever the number of tokens."""
    _, _, _, events = play(stages, 2 * micro, micro, micro, tokens)
    times = [e.time for e in events if e.stage == 0]
    assert times == list(range(len(times)))
    assert len(times) == micro * tokens
    assert bubbles(events, stages) == stages * (stages - 1)
    for s in range(stages):                                              # stage s: s fill units, then busy
        busy = [e.time for e in events if e.stage == s]
        assert busy == list(range(s, s + len(times)))


@pytest.mark.parametrize("stages, tokens", [(2, 1), (2, 2), (2, 7), (3, 4), (4, 5)])
def test_one_micro_batch_leaves_most_of_the_pipeline_idle(stages, tokens):
    """(e) one micro-batch: every step crosses the pipeline alone, so a stage works 1 unit in P:
    bubble fraction 1 - 1/P (exactly 1/2 for P=2)."""
    _, _, _, events = play(stages, 3, 1, 1, tokens)
    assert bubble_fraction(events, stages) == pytest.approx(1 - 1 / stages)
    assert [e.time for e in events if e.stage == 0] == [stages * k for k in range(tokens)]


# -------------------------------------------------------------------------------------- early stopping (EOS)

def test_a_finished_micro_batch_leaves_without_a_stall():
    """(f) P=2, four 1-sequence micro-batches needing 2, 5, 3 and 5 tokens. Micro-batch 0 leaves after step 1,
    micro-batch 2 after step 2; at least P micro-batches stay in flight until the end, so stage 0 works every unit
    from 0 to its last item: 4 prompt passes + (1 + 4 + 2 + 4) gen steps = 15 units, t = 0..14."""
    _, _, _, events = play(2, 4, 4, 4, [2, 5, 3, 5])
    stage0 = [e for e in events if e.stage == 0]
    assert [e.time for e in stage0] == list(range(15))
    assert [item(e) for e in stage0] == [
        ("prompt", 0, 0), ("prompt", 1, 0), ("prompt", 2, 0), ("prompt", 3, 0),
        ("gen", 0, 1), ("gen", 1, 1), ("gen", 2, 1), ("gen", 3, 1),
        ("gen", 1, 2), ("gen", 2, 2), ("gen", 3, 2),                     # 0 has left
        ("gen", 1, 3), ("gen", 3, 3),                                      # 2 has left
        ("gen", 1, 4), ("gen", 3, 4)]
    assert bubbles(events, 2) == 2                                       # fill and drain only


def test_a_stopped_sequence_leaves_its_micro_batch():
    """(f) P=2, gen micro-batches {0,1} {2,3}; sequence 0 needs 2 tokens, the others 4: micro-batch 0 carries
    (0, 1) in step 1 and (1,) afterwards."""
    _, _, _, events = play(2, 4, 2, 2, [2, 4, 4, 4])
    carried = {(e.micro_batch, e.token_step): e.sequences for e in events if e.phase == "gen" and e.stage == 1}
    assert carried == {(0, 1): (0, 1), (0, 2): (1,), (0, 3): (1,), (1, 1): (2, 3), (1, 2): (2, 3), (1, 3): (2, 3)}


def test_a_micro_batch_done_after_the_prompt_never_enters_the_generation_phase():
    _, _, _, events = play(2, 4, 2, 2, [1, 1, 3, 3])
    assert {item(e) for e in events if e.phase == "gen"} == {("gen", 1, 1), ("gen", 1, 2)}
    _, _, _, events = play(3, 4, 2, 2, 1)
    assert all(e.phase == "prompt" for e in events) and len(events) == 2 * 3


# ------------------------------------------------------------------------------------- hybrid regrouping

def test_gen_ready_order_by_hand():
    """(g) prompt micro-batches {0,1,2} {3,4,5} {6,7}; gen micro-batches {0..3} {4..7}: gen 0 holds sequence 3
    of prompt micro-batch 1, gen 1 holds 6 and 7 of prompt micro-batch 2."""
    assert gen_ready_order(micro_batches(8, 3), micro_batches(8, 2)) == [(1, 0), (2, 1)]
    assert gen_ready_order(micro_batches(8, 1), micro_batches(8, 4)) == [(0, 0), (0, 1), (0, 2), (0, 3)]
    assert gen_ready_order(micro_batches(8, 4), micro_batches(8, 1)) == [(3, 0)]
    assert gen_ready_order(micro_batches(6, 3), micro_batches(6, 3)) == [(0, 0), (1, 1), (2, 2)]
    # uneven split: gen {0,1,2} {3,4,5} {6,7} against prompt {0..4} {5..7}
    assert gen_ready_order(micro_batches(8, 2), micro_batches(8, 3)) == [(0, 0), (1, 1), (1, 2)]


@pytest.mark.parametrize("stages, n, prompt_mb, gen_mb", [(2, 8, 4, 1), (2, 8, 4, 2), (3, 8, 3, 2),
                                                          (2, 8, 1, 4), (4, 9, 2, 5), (3, 7, 7, 3)])
def test_a_gen_micro_batch_starts_after_all_its_prompt_micro_batches(stages, n, prompt_mb, gen_mb):
    """(g) the first gen step of a regrouped micro-batch enters stage 0 strictly after every prompt micro-batch
    that holds one of its sequences has left the last stage, and no earlier than gen_ready_order says."""
    prompt_groups, gen_groups, _, events = play(stages, n, prompt_mb, gen_mb, 3)
    left = {e.micro_batch: e.time for e in events if e.phase == "prompt" and e.stage == stages - 1}
    first_step = {e.micro_batch: e.time for e in events if e.phase == "gen" and e.stage == 0 and e.token_step == 1}
    for after, g in gen_ready_order(prompt_groups, gen_groups):
        holders = {p for p, group in enumerate(prompt_groups) if set(group) & set(gen_groups[g])}
        assert after == max(holders)
        assert first_step[g] > max(left[p] for p in holders)
    # gen micro-batches enter in order
    assert sorted(first_step, key=first_step.get) == list(range(len(gen_groups)))


def test_hybrid_one_gen_micro_batch_waits_for_the_whole_prompt_phase():
    """P=2, 4 prompt micro-batches then 1 gen micro-batch of all 8 sequences, 2 tokens each:

        t:        0    1    2    3    4    5    6
        stage 0:  p0   p1   p2   p3   .    g0.1 .
        stage 1:  .    p0   p1   p2   p3   .    g0.1

    p3 leaves stage 1 at t=4, so the single gen step enters stage 0 at t=5."""
    _, _, _, events = play(2, 8, 4, 1, 2)
    assert timeline(events, 0) == [("prompt", 0, 0), ("prompt", 1, 0), ("prompt", 2, 0), ("prompt", 3, 0), None,
                                   ("gen", 0, 1), None]
    assert bubbles(events, 2) == 4


def test_empty_schedule_has_no_bubble():
    assert bubble_fraction([], 3) == 0.0
