"""scripts/bench_decode.py's method labels: a budget or length after @, tree rounds after :s."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from specblock.evaluate.decoding.loop import Generation, IterationStats

_spec = importlib.util.spec_from_file_location(
    "bench_decode", Path(__file__).resolve().parents[2] / "scripts" / "bench_decode.py"
)
bench = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("bench_decode", bench)  # its dataclasses look their module up
_spec.loader.exec_module(bench)


@pytest.mark.parametrize(
    "label, parsed",
    [
        ("tree", ("tree", "", None)),
        ("tree@16", ("tree", "16", None)),
        ("tree@auto:s1", ("tree", "auto", 1)),
        ("tree:s2", ("tree", "", 2)),
        ("chain-token@6", ("chain-token", "6", None)),
        ("tree+lookup@auto", ("tree+lookup", "auto", None)),
    ],
)
def test_method_labels(label, parsed):
    assert bench.method_label(label) == parsed


def test_a_bad_round_count_is_refused():
    with pytest.raises(ValueError, match="tree rounds"):
        bench.method_label("tree@4:sx")


def test_rounds_in_a_label_override_the_trained_rounds_cap(greedy_setup, caplog):
    """`tree` takes the drafter folder's cap (trained_blocks 1: one round, with its log line); `tree:s2`
    asks for two rounds itself: it gets them, and the cap is neither applied nor logged for it."""
    import argparse
    import logging

    target, ds = greedy_setup
    args = argparse.Namespace(draft_length=3, num_drafts=2, temperature=0.0, max_new_tokens=4, drafter="sb")
    meta = {"trained_blocks": 1}
    with caplog.at_level(logging.INFO):
        capped = bench.method_decoders(args, target.model, [], ["tree"], ds["specblock"], None, meta)
    assert capped["tree"].cfg.tree.steps == 1
    assert "trees.specblock.steps=2 -> 1" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO):
        asked = bench.method_decoders(args, target.model, [], ["tree:s2"], ds["specblock"], None, meta)
    assert asked["tree:s2"].cfg.tree.steps == 2
    assert "-> 1" not in caplog.text


def _gen(tokens: int, calls: list[int], draft_s: float) -> Generation:
    its = [IterationStats(0, 1, 2, c, draft_s, 0.0) for c in calls]  # accepted, emitted, length, calls, s
    return Generation(list(range(tokens)), its, len(its), 1, 1.0, prefill_drafter_calls=5)


def _last_cells(split, method: str) -> list[str]:
    row = bench.decoding_table({("bfloat16", method): split}, temperature=0.7).splitlines()[-1]
    return [c.strip() for c in row.strip("|").split("|")]


def test_the_decoding_table_gives_drafter_calls_per_token_and_ms_per_call():
    """Calls are summed over the decoding phase (the prefill's drafter calls left out, as its seconds are):
    two generations of 4 new tokens, each 3 iterations of 2 calls in 6 ms -> 12 calls for 8 tokens."""
    s = bench.Split()
    for _ in range(2):
        s.add(_gen(5, [2, 2, 2], 0.006))
    s.runs.append((10, 1.0))
    assert s.calls == 12
    assert _last_cells(s, "tree")[-3:-1] == ["1.50", "3.00"]  # 12 / 8 calls per token; 36 ms / 12 calls
    plain = bench.Split()
    plain.add(Generation([1, 2, 3], [], 3, 3, 1.0))
    plain.runs.append((3, 1.0))
    assert _last_cells(plain, "autoregressive")[-3:-1] == ["–", "–"]
