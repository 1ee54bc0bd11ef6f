"""The auto tree budget's cost model: its choice and its online calibration (the loop: test_auto_sizes.py)."""

from __future__ import annotations

import math

import pytest
from omegaconf import OmegaConf

from specblock.evaluate.decoding.budget import (
    FIXED_MIN,
    GATE_MIN,
    SOLO_MIN,
    PROBE_EVERY,
    AutoBudget,
    ForwardCurve,
    choose_budget,
    isotonic,
    measure_forward_curve,
)
from specblock.evaluate.config import EvalConfig
from specblock.evaluate.decoding.trees import DraftTree, TreeConfig


def test_forward_curve_interpolates_and_never_decreases():
    samples = iter([10.0, 30.0, 20.0] * 3)  # size 4 measured faster than size 2: noise, pooled
    curve = measure_forward_curve(lambda n: next(samples) / 1e3, grid=(1, 2, 4), repeats=3)
    assert curve.ms == [10.0, 25.0, 25.0]
    line = ForwardCurve([1, 9], [10.0, 50.0])
    assert line(1) == 10.0 and line(5) == 30.0 and line(13) == 70.0  # linear inside and beyond


def test_forward_curve_keeps_each_sizes_fastest_time_so_one_slow_forward_does_not_lift_the_wider_sizes():
    """Interference only adds time: each size keeps its fastest of the walks. A median and a running maximum
    made 2, 4 and 8 tokens all cost 50 ms on these walks (medians 33 / 50 / 49 / 45; session 26: trees of 15
    nodes chosen whose forwards took 58 ms against 46 for 4)."""
    walks = [  # ms per walk of the grid (1, 2, 4, 8): the true costs 33 / 33 / 34 / 45 plus spikes
        [33.0, 50.0, 50.0, 45.0],
        [48.0, 50.0, 34.0, 52.0],
        [33.0, 33.0, 49.0, 45.0],
    ]
    samples = iter(v / 1e3 for walk in walks for v in walk)
    curve = measure_forward_curve(lambda n: next(samples), grid=(1, 2, 4, 8), repeats=3)
    assert curve.ms == [33.0, 33.0, 34.0, 45.0]


@pytest.mark.parametrize(
    "values, expected",
    [
        ([1.0, 2.0, 3.0], [1.0, 2.0, 3.0]),  # already non-decreasing: unchanged
        ([3.0, 1.0], [2.0, 2.0]),  # one violation: pooled
        ([1.0, 5.0, 2.0, 3.0, 6.0], [1.0, 10 / 3, 10 / 3, 10 / 3, 6.0]),  # pooled back until order holds
        ([4.0, 3.0, 2.0, 1.0], [2.5] * 4),
        ([], []),
    ],
)
def test_isotonic_is_the_closest_non_decreasing_sequence(values, expected):
    got = isotonic(values)
    assert got == pytest.approx(expected)
    assert all(a <= b for a, b in zip(got, got[1:]))
    assert sum(got) == pytest.approx(sum(values))  # pooling keeps the total (means of runs)


def test_choose_budget_stops_where_a_wider_forward_stops_paying():
    conf = [0.9, 0.8, 0.5, 0.3, 0.2, 0.1, 0.05, 0.05]
    flat = ForwardCurve([1, 64], [50.0, 50.0])  # a GPU: width is free -> everything
    assert choose_budget(conf, flat, fixed_ms=5.0)[0] == len(conf)
    # a CPU: each token fed costs 10 ms more -> only nodes worth more than their cost
    steep = ForwardCurve([1, 64], [50.0, 680.0])
    b, rate = choose_budget(conf, steep, fixed_ms=5.0)
    rates = [(1 + sum(conf[:k])) / (5.0 + steep(k + 1)) for k in range(1, len(conf) + 1)]
    assert b == 1 + max(range(len(rates)), key=rates.__getitem__) and math.isclose(rate, max(rates))
    assert 1 < b < len(conf)
    # a drafter known to be over-confident (c < 1) gets a smaller tree
    assert choose_budget(conf, steep, fixed_ms=5.0, c=0.2)[0] < b


def test_auto_budget_learns_its_calibration_online():
    auto = AutoBudget(curve=ForwardCurve([1, 64], [50.0, 680.0]))
    scores = [math.log(a) for a in (0.9, 0.8, 0.5, 0.3, 0.2, 0.1)]
    first = auto.choose(scores)
    for _ in range(20):  # predicted ~2.8 accepted nodes per iteration, none accepted
        auto.observe(scores, accepted=0, fixed_seconds=0.005)
    assert auto.c < 0.1 and auto.fixed_ms == pytest.approx(5.0)
    assert auto.choose(scores) < first and auto.chosen == [first, auto.chosen[-1]]


def test_a_curve_measured_under_load_is_rescaled_by_the_verification_forwards():
    true = ForwardCurve([1, 64], [50.0, 680.0])
    spiked = ForwardCurve([1, 64], [150.0, 2040.0])  # measured while the machine was 3x slower
    scores = [math.log(a) for a in (0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1)]
    fair, loaded = AutoBudget(curve=true), AutoBudget(curve=spiked)
    for auto in (fair, loaded):
        auto.observe(scores, accepted=3, fixed_seconds=0.05)
    assert loaded.choose(scores) < fair.choose(scores)  # the spike makes width look dear
    for n in (4, 8, 6, 10):  # the forwards the loop then measures cost what the true curve says
        loaded.observe_forward(n, true(n) / 1e3)
    assert loaded.load == pytest.approx(1 / 3) and loaded.forward(9) == pytest.approx(true(9))
    assert loaded.choose(scores) == fair.choose(scores)
    stalled = AutoBudget(curve=true)
    stalled.observe_forward(4, 100.0)  # one forward stalled for 100 s: the factor is clipped
    assert stalled.load == 4.0 and AutoBudget(curve=true).load == 1.0


def test_tree_budget_config():
    cfg = OmegaConf.to_object(
        OmegaConf.merge(OmegaConf.structured(EvalConfig), {"trees": {"specblock": {"budget": "auto"}}})
    )
    assert cfg.trees["specblock"].budget == "auto" and cfg.trees["specblock"].drafted == 64
    assert TreeConfig(budget=16).drafted == 16
    for bad in ("big", 0):
        with pytest.raises(ValueError, match="tree budget"):
            TreeConfig(budget=bad)


def test_draft_length_auto_config():
    from specblock.evaluate.run import decode_config

    cfg = EvalConfig(
        draft_length="auto", methods=["autoregressive", "chain-token", "chain-block", "lookup", "tree"]
    )
    chain, lookup = decode_config(cfg, "chain-token", "eagle3"), decode_config(cfg, "lookup", None)
    assert chain.auto_length and chain.draft_length == cfg.max_draft_length == 8
    assert not lookup.auto_length and lookup.draft_length == 8
    assert not decode_config(EvalConfig(), "chain-token", "eagle3").auto_length
    cfg = EvalConfig(draft_length="auto", methods=["iid-spectr_gbv", "chain-greedy_block", "tree"])
    iid, block = (
        decode_config(cfg, "iid-spectr_gbv", "eagle3"),
        decode_config(cfg, "chain-greedy_block", "eagle3"),
    )
    assert iid.auto_length and iid.draft_length == 8 and block.auto_length  # chosen before drafting
    assert not decode_config(cfg, "tree", "eagle3").auto_length  # a tree's size is its own budget
    with pytest.raises(ValueError, match="draft_length must be"):
        EvalConfig(draft_length="long")


def test_a_tree_round_expands_only_the_leaves_that_could_be_kept():
    """A frontier node whose children (never likelier than it) could not be among the optimistic best
    budget's nodes is not worth a drafter row: SpecBlock's round then starts blocks from fewer leaves."""
    auto = AutoBudget(curve=ForwardCurve([1, 2, 4, 8], [50.0, 55.0, 65.0, 85.0]))  # width costs
    scores = [math.log(0.9), math.log(0.6)]
    frontier = [math.log(a) for a in (0.8, 0.7, 0.05, 0.01)]
    n = auto.more_rounds(scores, frontier)
    assert n == 2  # the two likely leaves; children of 0.05 and 0.01 would not pay for their width
    free = AutoBudget(curve=ForwardCurve([1, 64], [50.0, 50.0]))  # width is free: every leaf may pay
    assert free.more_rounds(scores, frontier) == len(frontier)


def test_more_tree_rounds_only_while_they_can_pay():
    auto = AutoBudget(curve=ForwardCurve([1, 64], [50.0, 50.0]))  # width is free
    scores, frontier = [math.log(0.9), math.log(0.5)], [math.log(0.5), math.log(0.45)]
    assert auto.more_rounds(scores, frontier)  # the first round is free until one is measured
    auto.observe_rounds(1, 0.010)  # 10 ms a round: gaining up to ~0.95 tokens pays for it
    assert auto.round_ms == pytest.approx(10.0) and auto.more_rounds(scores, frontier)
    auto.observe_rounds(1, 1.990)  # 1 s a round: it cannot
    assert not auto.more_rounds(scores, frontier)


def test_the_gate_without_a_chain_weighs_a_plain_step_against_the_drafter():
    """No lookup chain (a tree with budget=auto): after SOLO_MIN drafted iterations, a plain step 1 /
    forward(1) against (1 + g) / (d + forward(1 + b)) with the drafter's decayed means; every PROBE_EVERY-th
    iteration asks the drafter anyway, and probes that find it paying open the gate again."""
    auto = AutoBudget(curve=ForwardCurve([1, 64], [50.0, 50.0 + 63 * 2.0]))
    for _ in range(SOLO_MIN):  # an answer's first iterations (the hardest to draft) are measured, not judged
        assert auto.lookup_alone(0) is None
        auto.observe_solo(0, 4, 0.010)  # 4 nodes verified, none accepted, 10 ms a call
    decisions = [auto.lookup_alone(0) for _ in range(2 * PROBE_EVERY)]
    assert decisions == ([0] * (PROBE_EVERY - 1) + [None]) * 2 and auto.skipped == 2 * (PROBE_EVERY - 1)
    for _ in range(3):  # the probes find a stretch the drafter knows: 3 of 4 nodes accepted
        auto.observe_solo(3, 4, 0.010)
    assert auto.lookup_alone(0) is None and auto.lookup_alone(0) is None


def test_the_gate_outlasts_an_unlucky_streak_of_a_drafter_that_pays():
    """The gate's memory (GATE_DECAY): a drafter that pays on average (one node in two iterations against a
    break-even of ~0.36 here) is still called after 3 rejected iterations in a row, the chance streak that
    closed the gate for 7 iterations at a time when an iteration's weight halved after ~3; a dozen rejected
    iterations in a row close it."""
    auto = AutoBudget(curve=ForwardCurve([1, 64], [50.0, 50.0 + 63 * 2.0]))
    for i in range(40):
        auto.observe_solo(i % 2, 4, 0.010)  # 4 nodes verified, 1 accepted every other iteration, 10 ms a call
    for _ in range(3):
        auto.observe_solo(0, 4, 0.010)
    assert auto.lookup_alone(0) is None
    for _ in range(12):
        auto.observe_solo(0, 4, 0.010)
    assert auto.lookup_alone(0) == 0


def test_a_further_round_that_its_record_says_does_not_pay_is_cut_with_probes():
    """Optimism drafts a round whenever children as likely as their parents could pay; the measured record
    of what that round added where it ran (accepted and kept nodes, drafter rounds) then decides: a round
    that added nothing is cut, except every PROBE_EVERY-th time it is asked, and a record that shows it
    paying keeps it."""
    auto = AutoBudget(curve=ForwardCurve([1, 64], [50.0, 50.0 + 63 * 1.0]))
    auto.observe_rounds(1, 0.008)  # 8 ms a round
    scores, frontier = [math.log(0.6), math.log(0.3)], [math.log(0.5), math.log(0.4)]
    for _ in range(GATE_MIN):  # measured: round 1 adds 3 kept nodes and accepts none of them
        auto.tree_rounds = 0
        assert auto.more_rounds(scores, frontier) and auto.tree_rounds == 1
        auto.observe_round_yield([0, 0, 1, 1, 1], [0])
        assert auto.tree_rounds == 0
    asked = []
    for _ in range(2 * PROBE_EVERY):
        asked.append(bool(auto.more_rounds(scores, frontier)))
        if asked[-1]:  # a probe: round 1 ran and added nothing again
            auto.observe_round_yield([0, 0, 1, 1, 1], [])
    assert asked == ([False] * (PROBE_EVERY - 1) + [True]) * 2
    assert auto.rounds_cut == 2 * (PROBE_EVERY - 1)
    for _ in range(4):  # a stretch where the round's blocks are accepted: 2 of its 3 nodes
        auto.tree_rounds = 1
        auto.observe_round_yield([0, 0, 1, 1, 1], [0, 1, 1])
    assert auto.more_rounds(scores, frontier)


def test_the_round_record_counts_every_later_round_for_an_earlier_one():
    """Round r's record counts the nodes of every round >= r (a round that only opens the next one, as an
    EAGLE step does, is credited with what the next one adds) and the drafter rounds they cost."""
    auto = AutoBudget(curve=ForwardCurve([1, 64], [50.0, 50.0]))
    auto.tree_rounds = 2
    auto.observe_round_yield([0, 1, 2, 2], [0, 1, 2])
    assert auto.round_gain == {1: 2.0, 2: 1.0} and auto.round_nodes == {1: 3.0, 2: 2.0}
    assert auto.round_calls == {1: 2.0, 2: 1.0} and auto.round_seen == {1: 1, 2: 1}


def test_tree_nodes_keep_the_round_that_drafted_them():
    tree = DraftTree()
    a = tree.add(0, 5, -0.1)
    b = tree.add(a, 6, -0.5, round=1)
    c = tree.add(0, 7, -2.0, round=1)
    assert tree.add(a, 6, -0.4, round=2) == b and tree.rounds == [0, 0, 1, 1]  # reused: the earlier round
    kept = tree.pruned(2)
    assert kept.tree.rounds == [0, 0, 1] and kept.old == [0, a, b] and c not in kept.old


def test_up_front_length_weighs_acceptance_width_and_cost_per_length():
    """choose_up_front (draft_length=auto for K i.i.d. drafts and block verifiers): L maximises
    (1 + sum A_i) / (fixed(L) + L draft + forward(K L + 1)) from past iterations; every PROBE_EVERY-th
    choice is one longer than the best; `shortest` (a continuation's horizon) bounds it from below."""

    def budget(ms: list[float]) -> AutoBudget:
        auto = AutoBudget(curve=ForwardCurve([1, 5, 9, 13, 17], ms))
        auto.fixed_total_ms, auto.iterations = 10.0, 1
        return auto

    free = budget([40.0] * 5)
    for _ in range(20):  # every iteration accepted all 4
        free.observe_depths(4, 4)
    assert free.choose_up_front(4, 4) == 4
    wide = budget([30.0, 33.0, 38.0, 43.0, 47.0])  # the K = 4 drafts' forward grows with L
    for accepted in [0, 1, 1, 2, 0, 1, 3, 1] * 3:
        wide.observe_depths(4, accepted)
    assert wide.choose_up_front(4, 4) == 2 and wide.choose_up_front(4, 4, shortest=3) == 3
    for _ in range(FIXED_MIN):  # a long block's verification measured dear (a continuation's rows)
        free.observe_depths(4, 4, fixed_seconds=0.5)
        free.observe_depths(3, 3, fixed_seconds=0.01)
    assert free.fixed_at(4) == pytest.approx(500.0) and free.fixed_at(2) == free.fixed_ms
    assert free.choose_up_front(4, 4) == 3
    probe = budget([30.0, 33.0, 38.0, 43.0, 47.0])
    choices = [probe.choose_up_front(4, 4) for _ in range(PROBE_EVERY)]
    assert set(choices[:-1]) == {choices[0]} and choices[0] < 4 and choices[-1] == choices[0] + 1
