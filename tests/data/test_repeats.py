"""data/repeats.py: answers cut where they first repeat a span they already hold."""

from __future__ import annotations

import pytest
import torch

from specblock.data.repeats import CutRepeats, cut_at_repeat, cut_row


def test_cut_at_the_token_that_completes_a_repeated_span():
    # prompt 7 7 7 (repeats there do not count), answer from index 3: 1 2 3 1 2 3 1 2
    ids = [7, 7, 7, 1, 2, 3, 1, 2, 3, 1, 2]
    mask = [0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1]
    assert cut_at_repeat(ids, mask, 2) == 7  # "1 2" again ends at index 7: keep 0..6
    assert cut_at_repeat(ids, mask, 3) == 8  # "1 2 3" again ends at index 8
    assert cut_at_repeat(ids, mask, 1) == 6  # "1" again at index 6
    assert cut_at_repeat(ids, mask, 9) == len(ids)  # no 9-token span repeats
    assert cut_at_repeat([5, 5, 5], [0, 0, 0], 1) == 3  # no answer: whole
    with pytest.raises(ValueError, match="n >= 1"):
        cut_at_repeat(ids, mask, 0)


def test_cut_row_cuts_every_per_token_field_as_views():
    T = 11
    ids = torch.tensor([7, 7, 7, 1, 2, 3, 1, 2, 3, 1, 2])
    row = {
        "input_ids": ids,
        "loss_mask": torch.tensor([0, 0, 0] + [1] * 8),
        "features": torch.randn(T, 6),
        "target_argmax": torch.arange(T),
        "id": "r1",
    }
    cut = cut_row(row, 2)
    assert [len(cut[k]) for k in ("input_ids", "loss_mask", "features", "target_argmax")] == [7] * 4
    assert cut["id"] == "r1" and torch.equal(cut["features"], row["features"][:7])
    assert cut["features"].data_ptr() == row["features"].data_ptr()  # a view
    whole = cut_row(row, 9)
    assert all(whole[k] is row[k] for k in row)
    lazy = CutRepeats([row, row], 2)
    assert len(lazy) == 2 and len(lazy[1]["input_ids"]) == 7
