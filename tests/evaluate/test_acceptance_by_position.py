"""scripts/acceptance_by_position.py: the teacher-forced counts it reports, on hand-made predictions."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

_spec = importlib.util.spec_from_file_location(
    "acceptance_by_position", Path(__file__).resolve().parents[2] / "scripts" / "acceptance_by_position.py"
)
abp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(abp)


def test_lookup_hit_follows_the_latest_earlier_match():
    seq = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3, 5]
    assert not abp.lookup_hit(seq, 2)  # too short for a 3-gram
    assert abp.lookup_hit(seq, 11)  # 1 2 3 was last followed by 5
    assert not abp.lookup_hit(seq, 7)  # 1 2 3 was followed by 4
    assert not abp.lookup_hit([1, 2, 3, 9], 3)  # no earlier match


def test_score_counts_the_run_from_slot_0_inside_the_answer():
    seq = [10, 11, 12, 13, 14, 15, 16]
    answer = [False, False, True, True, True, True, True]  # the answer starts at token 2
    pred = torch.tensor(
        [
            [12, 13, 99, 15],  # t=0 drafts tokens 2..5: slots 0-1 match, slot 2 misses -> run 2
            [99, 14, 15, 16],  # t=1: slot 0 misses -> run 0 though later slots match
            [14, 15, 16, 16],  # t=2: three match, the fourth is past the end -> run 3
            [15, 16, 0, 0],
            [16, 0, 0, 0],
        ]
    )
    rows = abp.score(pred, seq, answer)
    assert [r[0] for r in rows] == [0, 1, 2, 3, 4]  # answer offsets of tokens 2..6
    assert [r[1] for r in rows] == [1, 0, 1, 1, 1]
    assert [r[2] for r in rows] == [2, 0, 3, 2, 1]


def test_buckets_and_table():
    assert [abp.bucket(o) for o in (0, 63, 64, 191, 192, 5000)] == [
        "0-63",
        "0-63",
        "64-191",
        "64-191",
        "192+",
        "192+",
    ]
    text = abp.table({"0-63": [(0, 1, 2, True), (1, 0, 0, False)]}, "answer positions")
    assert "| 0-63 | 2 | 0.500 | 1.000 | 0.500 |" in text
