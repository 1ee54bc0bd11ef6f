"""The target's argmax beside a feature cache: computed once through the head, read back while the manifest is
the same, computed again for a new capture, never left half-written."""

import pytest
import torch

from specblock.data import target_argmax as ta
from specblock.data.target_argmax import ARGMAX_FILE, head_key, target_argmax


def rows_and_head(tmp_path, n=7, hidden=6, vocab=11):
    g = torch.Generator().manual_seed(0)
    (tmp_path / "manifest.json").write_text('{"capture": 1}')
    lengths = torch.randint(1, 9, (n,), generator=g).tolist()
    hidden_rows = [torch.randn(t, hidden, generator=g).bfloat16() for t in lengths]
    weight = torch.randn(vocab, hidden, generator=g).bfloat16()
    head = lambda h: torch.nn.functional.linear(h, weight)  # noqa: E731
    head.key = head_key(weight)
    return hidden_rows, head


def test_computed_once_then_read_back(tmp_path, monkeypatch):
    hidden, head = rows_and_head(tmp_path)
    monkeypatch.setattr(ta, "_BATCH_TOKENS", 5)  # several head calls, rows never split
    got = target_argmax(tmp_path, hidden, head, head.key)
    assert [len(t) for t in got] == [len(h) for h in hidden]
    for h, t in zip(hidden, got):
        assert torch.equal(t, head(h).float().argmax(-1))
    assert (tmp_path / ARGMAX_FILE).is_file() and [
        p.name for p in tmp_path.iterdir() if p.name.startswith(".")
    ] == []

    def no_head(h):
        raise AssertionError("the stored argmax should have been read")

    again = target_argmax(tmp_path, hidden, no_head, head.key)
    assert all(torch.equal(a, b) for a, b in zip(got, again))


def test_a_new_capture_computes_it_again(tmp_path):
    hidden, head = rows_and_head(tmp_path)
    target_argmax(tmp_path, hidden, head, head.key)
    (tmp_path / "manifest.json").write_text('{"capture": 2}')  # captured again: another manifest
    calls = []
    target_argmax(tmp_path, hidden, lambda h: calls.append(len(h)) or head(h), head.key)
    assert sum(calls) == sum(len(h) for h in hidden)


def test_other_rows_than_stored_are_computed_again(tmp_path):
    hidden, head = rows_and_head(tmp_path)
    target_argmax(tmp_path, hidden, head, head.key)
    calls = []
    fewer = hidden[:-1]  # the same manifest but other rows (a caller bug): not the stored numbers
    got = target_argmax(tmp_path, fewer, lambda h: calls.append(1) or head(h), head.key)
    assert calls and len(got) == len(fewer)


def test_a_crash_while_computing_leaves_no_file(tmp_path):
    hidden, head = rows_and_head(tmp_path)

    def broken(h):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        target_argmax(tmp_path, hidden, broken, head.key)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json"]


def test_a_crash_while_writing_leaves_no_file(tmp_path, monkeypatch):
    hidden, head = rows_and_head(tmp_path)

    def half_written(tensors, path, metadata=None):
        open(path, "wb").write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(ta, "save_file", half_written)
    with pytest.raises(OSError, match="disk full"):
        target_argmax(tmp_path, hidden, head, head.key)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json"]


def test_another_head_computes_it_again(tmp_path):
    """A float32 run's argmax may differ from a bf16 run's at near-ties: the head is part of the key."""
    hidden, head = rows_and_head(tmp_path)
    target_argmax(tmp_path, hidden, head, head_key(torch.ones(3, 2).bfloat16()))
    calls = []
    target_argmax(tmp_path, hidden, lambda h: calls.append(1) or head(h), head_key(torch.ones(3, 2)))
    assert calls
    assert (
        head_key(torch.ones(3, 2))
        != head_key(torch.ones(3, 2).bfloat16())
        != head_key(torch.zeros(3, 2).bfloat16())
    )
