"""The calling convention, the registry, seeded reproducibility, and the real sampler's law."""

from __future__ import annotations

import pytest
import torch

from specblock.evaluate.verify import SINGLE_DRAFT, VERIFIERS, TorchSampler, get_verifier
from specblock.evaluate.verify.exact import ExactSampler, TableModel, enumerate_outcomes, iteration_outcomes


def random_inputs(k=3, n=4, vocab=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.softmax(3 * torch.randn(n + 1, vocab, generator=g), -1)
    p = torch.softmax(3 * torch.randn(n, vocab, generator=g), -1)
    x = torch.stack([torch.multinomial(p, 1, generator=g).squeeze(-1) for _ in range(k)])
    return q.expand(k, n + 1, vocab).contiguous(), p.expand(k, n, vocab).contiguous(), x


@pytest.mark.parametrize("name", sorted(VERIFIERS))
def test_seeded_calls_are_reproducible_and_well_formed(name):
    k = 1 if name in SINGLE_DRAFT else 3
    tp, dp, x = random_inputs(k=k)
    a, b = (get_verifier(name)(tp, dp, x, torch.Generator().manual_seed(5)) for _ in range(2))
    assert (a.num_accepted, a.draft_index, a.next_token) == (b.num_accepted, b.draft_index, b.next_token)
    assert 0 <= a.num_accepted <= 4 and 0 <= a.draft_index < k and 0 <= a.next_token < 50
    assert (a.continuation is not None) == (name in ("greedy_block", "spectr_gbv"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["block", "spectr", "rrs", "spectr_gbv"])
def test_low_precision_inputs_are_accepted(name, dtype):
    k = 1 if name in SINGLE_DRAFT else 3
    tp, dp, x = random_inputs(k=k)
    out = get_verifier(name)(tp.to(dtype), dp.to(dtype), x, torch.Generator().manual_seed(1))
    assert 0 <= out.next_token < 50


def test_bad_shapes_and_names_fail_clearly():
    tp, dp, x = random_inputs(k=2)
    with pytest.raises(ValueError, match="single draft"):
        get_verifier("block")(tp, dp, x)
    with pytest.raises(ValueError, match="shape mismatch"):
        get_verifier("spectr")(tp[:, :3], dp, x)
    with pytest.raises(ValueError, match="expected target_probs"):
        get_verifier("rrs")(tp[0], dp, x)
    with pytest.raises(ValueError, match="integer tensor"):
        get_verifier("rrs")(tp, dp, x.float())
    with pytest.raises(KeyError, match="registered"):
        get_verifier("medusa")


def test_torch_sampler_primitives_match_their_exact_laws():
    """ExactSampler proves the verifiers; this ties the real TorchSampler to the same laws."""
    a = torch.tensor([0.7, 0.4, 0.9], dtype=torch.float64)
    w = torch.tensor([0.1, 0.0, 0.5, 0.4], dtype=torch.float64)

    def program(s):
        return s.first_failure(a), s.bernoulli(0.25), s.categorical(w)

    exact = {o: p for p, o in enumerate_outcomes(program)}
    sampler, n = TorchSampler(torch.Generator().manual_seed(0)), 40_000
    counts: dict = {}
    for _ in range(n):
        o = program(sampler)
        counts[o] = counts.get(o, 0) + 1
    assert set(counts) <= set(exact)
    for o, p in exact.items():
        sigma = (p * (1 - p) / n) ** 0.5
        assert abs(counts.get(o, 0) / n - p) < 5 * sigma + 1e-4, (o, p)


@pytest.mark.parametrize("name,k", [("block", 1), ("spectr_gbv", 2)])
def test_real_sampling_matches_the_exact_outcome_law(name, k):
    target, draft = TableModel(4, seed=1, alpha=0.7), TableModel(4, seed=2, alpha=0.7)
    exact: dict = {}
    for o in iteration_outcomes(get_verifier(name), target, draft, k, 2):
        exact[o.emitted] = exact.get(o.emitted, 0.0) + o.prob
    g, n, counts = torch.Generator().manual_seed(0), 6000, {}
    for _ in range(n):
        drafts = []
        for _ in range(k):
            y = ()
            for _ in range(2):
                y += (int(torch.multinomial(draft(y), 1, generator=g)),)
            drafts.append(y)
        tp = torch.stack([torch.stack([target(d[:i]) for i in range(3)]) for d in drafts])
        dp = torch.stack([torch.stack([draft(d[:i]) for i in range(2)]) for d in drafts])
        out = get_verifier(name)(tp, dp, torch.tensor(drafts), g)
        e = drafts[out.draft_index][: out.num_accepted] + (out.next_token,)
        counts[e] = counts.get(e, 0) + 1
    for e, p in exact.items():
        assert abs(counts.get(e, 0) / n - p) < 5 * (p * (1 - p) / n) ** 0.5 + 1e-3, (e, p)


def test_exact_sampler_prunes_impossible_branches():
    s = ExactSampler([])
    assert s.bernoulli(1.0) is True and s.options == [1]


class _ScriptedUniforms(TorchSampler):
    """A TorchSampler whose uniforms come from a list (to pin the inverse CDF's input)."""

    def __init__(self, us):
        super().__init__()
        self._block = list(us)


def test_two_level_categorical_is_the_inverse_cdf():
    """Over a large vocabulary TorchSampler.categorical goes through block sums; it must pick the token
    the plain float64 inverse CDF picks, never a zero-weight one, including at u just below 1."""
    g = torch.Generator().manual_seed(0)
    w = torch.rand(5000, generator=g, dtype=torch.float32) ** 8
    w[w < 0.05] = 0.0  # many zero weights, whole zero blocks too
    w[1024:2048] = 0.0
    w[-7:] = 0.0  # the tail past the last full block ends in zeros
    cdf = torch.cumsum(w, 0, dtype=torch.float64)
    us = torch.rand(400, generator=g, dtype=torch.float64).tolist() + [0.0, 1.0 - 2**-53, 0.5]
    s = _ScriptedUniforms(us)
    for u in us:
        got = s.categorical(w)
        ref = int(torch.searchsorted(cdf, u * float(cdf[-1]), right=True))
        assert w[got] > 0
        assert got == min(ref, int(torch.nonzero(w)[-1])), u


def test_a_running_ratio_below_float32s_range_is_verified_in_float64():
    """Block verification of a long chain of tokens the target finds unlikely: its running ratio p_i falls
    below 1e-38, so lam = 1 / p_i does not fit float32 (the main job's T = 0.7 stage crashed on it at
    L = 8). The residuals are then taken in float64: the outcome law from float32 inputs equals the one
    from float64 inputs, where lam fits; lam = inf keeps q where p = 0."""
    from specblock.evaluate.verify.residuals import residual_law, residual_mass

    L, V = 8, 4
    q = torch.full((1, L + 1, V), 1e-6, dtype=torch.float64)
    q[..., 1:] = (1 - 1e-6) / (V - 1)
    p = torch.full((1, L, V), 0.0, dtype=torch.float64)
    p[..., 0], p[..., 1] = 0.999, 0.001  # token 0 drafted every time: ratio ~1e-6 per step
    tokens = torch.zeros(1, L, dtype=torch.int64)

    def law(dtype):
        out = enumerate_outcomes(lambda s: VERIFIERS["block"](q.to(dtype), p.to(dtype), tokens, sampler=s))
        merged: dict = {}
        for w, o in out:
            merged[(o.num_accepted, o.next_token)] = merged.get((o.num_accepted, o.next_token), 0.0) + w
        return merged

    wide, narrow = law(torch.float64), law(torch.float32)
    assert set(wide) == set(narrow) and all(abs(wide[k] - narrow[k]) < 1e-6 for k in wide)
    row_q, row_p = q[0, 0].float(), p[0, 0].float()
    assert residual_mass(row_q, row_p, 1e42) == pytest.approx(float(row_q[2:].sum()), rel=1e-6)
    assert torch.equal(
        residual_law(row_q, row_p, float("inf")), torch.cat([torch.zeros(2), row_q[2:]]).double()
    )
