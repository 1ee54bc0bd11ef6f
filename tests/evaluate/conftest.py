"""Fixtures the decoding tests share: the tiny targets and drafters of tests/support/tiny_decoding.py."""

from __future__ import annotations

import pytest

from tiny_decoding import PROMPT, VOCAB, OracleRoot, drafters, near_target_law, tiny_target


@pytest.fixture(scope="module")
def greedy_setup():
    target = tiny_target(64, 1.0)
    return target, drafters(target)


@pytest.fixture
def exact_setup():  # function scope: its patch of the drafting code must not outlive its test
    """A 24-token target whose top-p 0.5 law leaves 38 three-token sequences, and a draft law near the
    target's (its logits plus fixed noise, patched over the real drafter's output) so that blocks are
    often accepted in part: the case where a missing continuation shows."""
    target = tiny_target(VOCAB, 12.0, seed=2)
    ds = drafters(target, seed=3)
    patch = OracleRoot(near_target_law(target), len(PROMPT))
    yield target, ds
    patch.uninstall()
