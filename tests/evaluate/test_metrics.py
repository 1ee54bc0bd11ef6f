"""Metrics are ratios of global sums: hand-built counts with exact expected values."""

import pytest

from specblock.evaluate.reporting.metrics import (
    AUTOREGRESSIVE,
    OVERALL,
    Accumulator,
    Counts,
    acceptance_at,
    block_efficiency,
    derived,
    is_autoregressive,
    tau,
)


def chain_step(acc: Accumulator, dataset: str, accepted: int, draft_len: int = 3) -> None:
    """A chain drafter: one drafter call per draft token, one target call, accepted + 1 tokens emitted."""
    acc.add_iteration(
        dataset,
        "chain",
        accepted=accepted,
        emitted=accepted + 1,
        draft_len=draft_len,
        drafter_calls=draft_len,
        drafter_seconds=0.25,
        verify_seconds=0.125,
    )


def built() -> Accumulator:
    """Dataset a: 2 iterations accepting 2 then 0 of 3; dataset b: 1 iteration accepting all 3.
    Autoregressive on a: 4 tokens in 2 s; chain on a: 4 tokens in 1 s."""
    acc = Accumulator()
    chain_step(acc, "a", 2)
    chain_step(acc, "a", 0)
    acc.add_generation("a", "chain", tokens=4, seconds=1.0)
    chain_step(acc, "b", 3)
    acc.add_generation("b", "chain", tokens=4, seconds=2.0)
    acc.add_generation("a", AUTOREGRESSIVE, tokens=4, seconds=2.0, target_calls=4)
    return acc


def test_hand_built_counts():
    c = built().get("a", "chain")
    assert (c.iterations, c.accepted, c.emitted, c.target_calls, c.drafter_calls) == (2, 2, 4, 2, 6)
    assert (c.generations, c.tokens, c.accepted_at, c.offered_at) == (1, 4, [1, 1], [2, 2, 2])
    m = derived(c)
    assert m["tau"] == 1.0  # 2 accepted / 2 iterations
    assert m["block_efficiency"] == 2.0  # 4 emitted / 2 target calls (bonus token counted)
    assert m["acceptance_at"] == [0.5, 0.5, 0.0]
    assert m["drafter_calls_per_token"] == 1.5  # 6 / 4
    assert m["drafter_seconds_per_token"] == 0.125  # 0.5 s / 4
    assert m["verify_seconds_per_token"] == 0.0625  # 0.25 s / 4
    assert m["tokens_per_second"] == 4.0


def test_autoregressive_and_speedup():
    acc = built()
    ar = acc.get("a", AUTOREGRESSIVE)
    assert block_efficiency(ar) == 1.0  # every target call outside iterations emits one token
    assert tau(ar) is None and acceptance_at(ar) == []  # no iterations: undefined, not zero
    assert acc.speedup("a", "chain") == 2.0  # 4 tok/s over 2 tok/s
    assert acc.speedup("b", "chain") is None  # no autoregressive reference on b
    assert acc.speedup(OVERALL, "chain") == pytest.approx((8 / 3) / 2)  # 8 tokens / 3 s over 2 tok/s


def test_speedup_counts_against_the_fastest_plain_decoding():
    """With plain decoding in two precisions, the faster one overall is every speedup's denominator
    (on a CPU a one-token bf16 step can lose to float32); the same-precision ratio stays available."""
    acc = built()  # autoregressive (the evaluation's precision) on a: 4 tokens in 2 s
    assert acc.reference() == AUTOREGRESSIVE
    acc.add_generation("a", "autoregressive@float32", tokens=4, seconds=1.6, target_calls=4)
    assert is_autoregressive("autoregressive@float32") and not is_autoregressive("lookup")
    assert acc.reference() == "autoregressive@float32"  # 2.5 tok/s beats 2
    assert acc.speedup("a", "chain") == pytest.approx(4.0 / 2.5)
    assert acc.speedup("a", "chain", AUTOREGRESSIVE) == 2.0
    assert acc.speedup("a", AUTOREGRESSIVE) == pytest.approx(0.8)  # the plain run itself is below 1x
    acc.add_generation("a", "autoregressive@float32", tokens=4, seconds=4.4, target_calls=4)
    assert acc.reference() == AUTOREGRESSIVE  # now 8 tokens / 6 s: the slower one, not the reference


def test_overall_is_sum_over_sum_not_mean_of_means():
    acc = built()
    tau_a, tau_b = tau(acc.get("a", "chain")), tau(acc.get("b", "chain"))
    assert (tau_a, tau_b) == (1.0, 3.0)
    overall = acc.get(OVERALL, "chain")
    assert tau(overall) == pytest.approx(5 / 3)  # (2 + 3) accepted / (2 + 1) iterations
    assert tau(overall) != pytest.approx((tau_a + tau_b) / 2)  # the mean of means would say 2.0
    assert block_efficiency(overall) == pytest.approx(8 / 3)
    assert acceptance_at(overall) == pytest.approx([2 / 3, 2 / 3, 1 / 3])
    assert [(d, m) for d, m, _ in acc.cells()][-2:] == [(OVERALL, "chain"), (OVERALL, AUTOREGRESSIVE)]


def test_merge_of_shards_equals_one_accumulator():
    whole, rank0, rank1 = Accumulator(), Accumulator(), Accumulator()
    for i, accepted in enumerate([2, 0, 3, 1]):
        chain_step(whole, "a", accepted)
        chain_step(rank0 if i % 2 else rank1, "a", accepted)
    rank1.add_generation("b", "chain", tokens=3, seconds=1.5)  # a key only one rank has
    whole.add_generation("b", "chain", tokens=3, seconds=1.5)
    merged = Accumulator.gather([rank0.to_dict(), rank1.to_dict()])
    assert merged.counts == whole.counts
    assert tau(merged.get("a", "chain")) == 1.5  # 6 / 4, not a mean of the ranks' 0.5 and 2.5


def test_dict_round_trip_and_strict_keys():
    acc = built()
    assert Accumulator.from_dict(acc.to_dict()).counts == acc.counts
    with pytest.raises(TypeError):
        Counts.from_dict({"iterations": 1, "renamed_field": 2})


def test_counts_add_pads_position_arrays():
    c = Counts(accepted_at=[1], offered_at=[2, 2]) + Counts(accepted_at=[1, 1, 1], offered_at=[1, 1, 1])
    assert (c.accepted_at, c.offered_at) == ([2, 1, 1], [3, 3, 1])


def test_invalid_inputs_fail_loudly():
    acc = Accumulator()
    with pytest.raises(ValueError, match="accepted=4"):
        acc.add_iteration("a", "chain", accepted=4, emitted=5, draft_len=3, drafter_calls=3)
    with pytest.raises(ValueError, match="reserved"):
        acc.add_generation(OVERALL, "chain", tokens=1, seconds=1.0)


def test_time_split_sums_before_dividing_and_overhead_is_the_rest():
    acc = Accumulator()
    acc.add_iteration(
        "a", "lookup", accepted=2, emitted=3, draft_len=3, drafter_calls=0,
        drafter_seconds=0.25, verify_seconds=0.125, target_seconds=1.0,
    )  # fmt: skip
    acc.add_generation(
        "a", "lookup", tokens=4, seconds=2.0, target_calls=1, target_seconds=0.5,
        drafter_calls=1, drafter_seconds=0.125,
    )  # fmt: skip
    c = acc.get(OVERALL, "lookup")
    assert (c.target_seconds, c.drafter_seconds, c.drafter_calls) == (1.5, 0.375, 1)
    m = derived(c)
    assert m["target_seconds_per_token"] == 1.5 / 4
    assert m["overhead_seconds_per_token"] == (2.0 - 0.375 - 1.5 - 0.125) / 4
    older = {k: v for k, v in c.to_dict().items() if k != "target_seconds"}  # a record from before the field
    assert Counts.from_dict(older).target_seconds == 0
