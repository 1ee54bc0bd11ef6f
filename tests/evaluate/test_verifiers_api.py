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
