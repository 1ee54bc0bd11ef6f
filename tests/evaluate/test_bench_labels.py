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
