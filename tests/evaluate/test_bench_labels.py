"""scripts/bench_decode.py's method labels: a budget or length after @, tree rounds after :s."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

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
