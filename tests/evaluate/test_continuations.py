"""What a cross-iteration verifier's continuation costs in the loop (evaluate/decoding/continuations.py):
its rows come out normalised without an extra pass over the vocabulary, and the levels the LawBook keeps
stay bounded however long the generation."""

from __future__ import annotations

import copy

import torch

from specblock.evaluate.decoding.continuations import LawBook
from specblock.evaluate.decoding.loop import DecodeConfig, SpeculativeDecoder
from specblock.evaluate.verify.continuation import RGBVContinuation, Stage, row_law

from tiny_decoding import PROMPT, drafters, tiny_target


def random_lookups(seed: int, V: int = 4096):
    """(target_at, draft_at): a random float32 law per prefix (as in the loop), made on first ask and kept."""
    gen, laws = torch.Generator().manual_seed(seed), {}

    def law_at(kind):
        def at(y):
            key = (kind, tuple(y))
            if key not in laws:
                laws[key] = torch.softmax(3 * torch.randn(V, generator=gen), -1)
            return laws[key]

        return at

    return law_at("q"), law_at("p")


def test_continuation_rows_are_normalised_by_the_coupling_mass_bit_for_bit():
    """The row after a stage is (q - lam p)_+ divided by S(lam), the mass the coupling already summed:
    bitwise the same float32 row as dividing by its own sum (the old, one pass longer computation)."""
    n = 3
    target_at, draft_at = random_lookups(seed=0)
    stages = (Stage((1, 2, 0), 0), Stage((5, 0, 3), 0), Stage((7, 7, 7), 0))  # nothing committed
    cont = RGBVContinuation(stages, n)
    checked, y, alive = 0, (), []
    for _ in range(n):  # live prefixes: each extends the last by a token its continuation row keeps
        alive.append(y)
        y += (int(cont(y, target_at, draft_at).argmax()),)
    for y in alive:
        got = cont(y, target_at, draft_at)
        coupling = cont._coupling(target_at, draft_at)
        row = coupling.law(len(cont.stages), y)
        old = row_law(coupling.rows, y, row)
        assert torch.equal(got, old / old.sum()), y
        checked += row.token is None and row.lam > 0
    assert checked >= n  # the live rows are residuals: the path that skips the sum


def test_prepared_rows_equal_the_rows_asked_one_by_one():
    """`prepare` (what the loop calls before a verification reads a level's rows) computes the rows' laws
    after every stage in one batch over [rows, V]: the same laws as asked one by one, normalised."""
    n = 3
    target_at, draft_at = random_lookups(seed=1)
    stages = (Stage((1, 2, 0), 1), Stage((1, 0, 3), 0), Stage((7, 7, 7), 0))  # token 1 committed first
    one_by_one, batched = RGBVContinuation(stages, n), RGBVContinuation(stages, n)
    # live prefixes (the committed token 1, then tokens the law after it keeps), a dead one, the horizon
    top = one_by_one((1,), target_at, draft_at).topk(3).indices.tolist()
    prefixes = [(2,), *((1, x) for x in top), (1, top[0], 5)]
    asked = sorted({y[:m] for y in prefixes for m in range(len(y) + 1)}, key=len)
    batched.prepare([y for y in asked if batched.reads_draft(y)], target_at, draft_at)
    made = batched._coupling(target_at, draft_at).final
    assert len(made) >= 3  # the residual rows came from the batch (not a vacuous comparison)
    for y in asked:
        a, b = one_by_one(y, target_at, draft_at), batched(y, target_at, draft_at)
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-9), y
        assert abs(float(b.double().sum()) - 1.0) < 1e-5, y


def test_frozen_levels_do_not_pile_up():
    """SpecTr-GBV at T > 0 with a poor drafter: blocks are rejected early, so a new continuation comes into
    force every iteration and the old ones freeze. The book keeps the live levels and the one frozen level
    the oldest live one reads, at most L + 1, however many iterations pass without a reset."""
    target = tiny_target(64, 1.0)
    drafter = copy.deepcopy(drafters(target)["eagle3"])
    with torch.no_grad():
        drafter.lm_head.weight.add_(
            torch.randn(drafter.lm_head.weight.shape, generator=torch.Generator().manual_seed(0))
        )
    L = 3
    seen, run, longest = [], [0], [0]
    carry = LawBook.carry

    def recording(book, *args):
        carry(book, *args)
        run[0] = run[0] + 1 if book.levels else 0  # iterations since the book last dropped every level
        longest[0] = max(longest[0], run[0])
        seen.append(len(book.levels))

    LawBook.carry = recording
    try:
        cfg = DecodeConfig("iid", "spectr_gbv", 3, L, 1.0, max_new_tokens=40)
        dec = SpeculativeDecoder(target, drafter, cfg)
        for seed in range(3):
            dec.generate(PROMPT, seed=seed)
    finally:
        LawBook.carry = carry
    assert longest[0] > 2 * (L + 1)  # long enough that unpruned levels would exceed the bound
    assert max(seen) <= L + 1
