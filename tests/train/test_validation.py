"""Validation's batches: the held-out rows visited once each, in length order, with the same metrics."""

import pytest
import torch
from accelerate import Accelerator

from specblock.train.metric_window import MetricWindow
from specblock.train.validation import evaluate, length_order

import tiny_strategy as tiny  # tests/support


def test_length_order_sorts_by_tokens_and_keeps_ties_in_order():
    rows = [{"input_ids": [0] * n} for n in (5, 2, 7, 2, 1)]
    assert length_order(rows) == [4, 1, 3, 0, 2]
    assert length_order([{"x": 1}, {"x": 2}]) == [0, 1]  # no token ids: the dataset's order


def test_evaluate_visits_rows_in_the_given_order_with_the_same_metrics():
    rows = tiny.make_dataset(n=10)
    acc = Accelerator(cpu=True)
    strategy = tiny.TinyStrategy()
    seen: list[list[int]] = []

    def collate(batch):
        seen.append([next(i for i, r in enumerate(rows) if r is row) for row in batch])
        return tiny.collate(batch)

    def run(order):
        seen.clear()
        return evaluate(acc, strategy, rows, collate, 3, 0, lambda: MetricWindow(acc.device), order)

    plain = run(None)
    assert seen == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    order = [9, 3, 1, 7, 0, 2, 8, 4, 6, 5]
    shuffled = run(order)
    assert seen == [[9, 3, 1], [7, 0, 2], [8, 4, 6], [5]]
    assert shuffled.keys() == plain.keys()
    for key in plain:  # ratios of global sums: only the order of the additions differs
        assert shuffled[key] == pytest.approx(plain[key], rel=1e-6), key
    with pytest.raises(ValueError, match="each of the 10 rows once"):
        run([0, 0, 1, 2, 3, 4, 5, 6, 7, 8])
    assert strategy.module.training  # evaluate leaves the module in training mode


def test_length_order_makes_batches_of_similar_rows():
    """Rows of lengths 1..8 in a scrambled order: batches of 2 in length order pad at most one token."""
    lengths = [8, 1, 6, 3, 5, 2, 7, 4]
    rows = [{"input_ids": torch.zeros(n, dtype=torch.long)} for n in lengths]
    order = length_order(rows)
    batches = [[lengths[i] for i in order[s : s + 2]] for s in range(0, len(order), 2)]
    assert all(max(b) - min(b) <= 1 for b in batches)


def test_the_validator_batches_the_held_out_rows_by_length():
    from specblock.train.tracking import NullTracker
    from specblock.train.validation import Validator

    rows = tiny.make_dataset(n=6)
    for row, n in zip(rows, (4, 1, 6, 2, 5, 3)):
        row["input_ids"] = torch.zeros(n, dtype=torch.long)
    seen: list[list[int]] = []

    def collate(batch):
        seen.append([len(r["input_ids"]) for r in batch])
        return tiny.collate([{k: v for k, v in r.items() if k != "input_ids"} for r in batch])

    acc = Accelerator(cpu=True)
    v = Validator(rows, collate, 2, "acc", "max", lambda: MetricWindow(acc.device))
    assert v.run(acc, tiny.TinyStrategy(), NullTracker(), step=1)  # the first result is the best so far
    assert seen == [[1, 2], [3, 4], [5, 6]] and "val/acc" in v.last
