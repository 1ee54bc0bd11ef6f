"""What a cross-iteration verifier's continuation costs in the loop (evaluate/decoding/continuations.py):
its rows come out normalised without an extra pass over the vocabulary, and the levels the LawBook keeps
stay bounded however long the generation."""

from __future__ import annotations

import copy

import torch

from specblock.evaluate.decoding.continuations import LawBook
from specblock.evaluate.decoding.loop import DecodeConfig, SpeculativeDecoder
from specblock.evaluate.verify.continuation import Coupling, RGBVContinuation, RowLaw, Stage, row_law
from specblock.evaluate.verify.residuals import Rows, residual_law, residual_masses

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


def beyond_case(V: int = 64, seed: int = 2):
    """q, p [2, V] float32 laws (p zero on every 4th token) and lams (one past float32's range, one not):
    the rows a long chain of unlikely tokens leaves (lam = 1 / a running ratio below 1e-38)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.softmax(torch.randn(2, V, generator=gen), -1)
    p = torch.softmax(torch.randn(2, V, generator=gen), -1)
    p[:, ::4] = 0.0
    p /= p.sum(-1, keepdim=True)
    return q, p, [1e39, 0.7]


def test_final_laws_leave_float32_where_lam_is_past_its_range():
    """`Coupling._final_laws` with a lam beyond float32 (`beyond`): the row is (q - lam p)_+ / S(lam) made in
    float64, finite and normalised (in float32 lam is inf and inf * 0 is NaN where p = 0), and the other rows
    keep the batched float32 arithmetic."""
    q, p, lams = beyond_case()
    masses = residual_masses(q, p, lams)
    coupling = Coupling(Rows(lambda y: q[0], lambda y: p[0]), horizon=4)
    ys = [(3,), (5,)]
    coupling._final_laws(ys, q, p, [(0.5, lam, None, s) for lam, s in zip(lams, masses)])
    far, near = coupling.final[ys[0]], coupling.final[ys[1]]
    assert far.dtype == torch.float32 and torch.isfinite(far).all()
    expected = q[0].double() * (p[0] == 0)  # only p = 0 survives lam = 1e39
    assert torch.allclose(far.double(), expected / expected.sum(), atol=1e-7)
    assert torch.equal(near, residual_law(q[1], p[1], lams[1]).div_(masses[1]))
    naive = torch.addcmul(q[:1], p[:1], torch.tensor([[lams[0]]]), value=-1.0).clamp_(min=0)
    assert not torch.isfinite(naive).all()  # what the branch avoids


def test_a_continuation_row_past_float32_is_made_in_float64():
    """RGBVContinuation's own row (the prefix not prepared in a batch) with a lam beyond float32: the law
    (q - lam p)_+ / S(lam) from float64, returned in q's dtype and written into `out` when given."""
    q, p, lams = beyond_case()
    cont = RGBVContinuation((Stage((1, 2, 0), 0),), horizon=3)
    target_at, draft_at = (lambda y: q[0]), (lambda y: p[0])
    coupling = cont._coupling(target_at, draft_at)
    coupling._law[(1, ())] = RowLaw(lam=lams[0])  # the row after the stage, as a long chain leaves it
    expected = q[0].double() * (p[0] == 0)
    out = torch.empty_like(q[0])
    got = cont((), target_at, draft_at, out=out)
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    assert torch.allclose(got.double(), expected / expected.sum(), atol=1e-7)
    assert torch.equal(out, got)
