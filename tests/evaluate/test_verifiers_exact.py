"""Every chain and multi-draft verifier preserves the target law EXACTLY, proven by enumerating every
draft tuple and every random outcome of the real verifier code on tiny random autoregressive models.

Vocabularies are 4 to 6 (some bugs hide at V = 3), blocks L <= 3, drafts K <= 3. The draft laws of the
larger cases are sparse (a token gets probability 0 with chance 0.4) to keep (V^L)^K small; the target
keeps full support, and p = 0 < q is itself an edge case the verifiers must handle.
"""

from __future__ import annotations

import pytest
import torch

from specblock.evaluate.verify import CROSS_ITERATION, SINGLE_DRAFT, VerifyOutput, get_verifier
from specblock.evaluate.verify.chain import block_ratios
from specblock.evaluate.verify.exact import (
    TableModel,
    decode_law,
    expected_accepted,
    iteration_law,
    iteration_outcomes,
    law_error,
    sequences,
)
from specblock.evaluate.verify.continuation import Coupling, RGBVContinuation, Stage, committed_reach, row_law
from specblock.evaluate.verify.residuals import draft_rows
from specblock.evaluate.verify.multidraft import RHO_TOL
from specblock.evaluate.verify.randomness import ACC_DTYPE, backward_scan, make_sampler

TOL = 1e-9
STOCHASTIC = ["token", "block", "greedy_block", "spectr", "rrs", "spectr_gbv"]
# (V, K, L, draft sparsity)
CASES = [
    (4, 1, 1, 0.0),
    (4, 1, 2, 0.0),
    (5, 1, 3, 0.0),
    (6, 1, 2, 0.0),
    (4, 2, 1, 0.0),
    (4, 2, 2, 0.0),
    (4, 3, 1, 0.0),
    (4, 2, 3, 0.4),
    (4, 3, 2, 0.5),
    (5, 2, 2, 0.3),
]


def models(vocab: int, seed: int, sparsity: float = 0.0, greedy: bool = False):
    target = TableModel(vocab, seed=seed, alpha=0.6, greedy=greedy)
    draft = TableModel(vocab, seed=1000 + seed, alpha=0.6, sparsity=sparsity)
    return target, draft


SLOW_CASES = {("spectr", (4, 2, 3, 0.4))}  # ~11 s of the ~19 s the 36 cases take (the fast tier skips it)


def applicable(name: str, k: int) -> bool:
    return not (name in SINGLE_DRAFT and k > 1)


@pytest.mark.parametrize(
    "name,vocab,k,n,sparsity",
    [
        pytest.param(name, *case, marks=[pytest.mark.slow] if (name, case) in SLOW_CASES else [])
        for name in STOCHASTIC
        for case in CASES
        if applicable(name, case[1])
    ],
)
def test_one_iteration_is_lossless(name, vocab, k, n, sparsity):
    target, draft = models(vocab, seed=vocab * 10 + k * 3 + n, sparsity=sparsity)
    outcomes = iteration_outcomes(get_verifier(name), target, draft, k, n)
    assert abs(sum(o.prob for o in outcomes) - 1.0) < TOL
    assert law_error(iteration_law(outcomes, target, draft, n), target, n + 1) < TOL


@pytest.mark.parametrize(
    "name,k", [(name, k) for name in STOCHASTIC + ["greedy"] for k in (1, 2) if applicable(name, k)]
)
def test_temperature_zero_target_is_lossless_and_greedy(name, k):
    target, draft = models(4, seed=7, greedy=True)
    outcomes = iteration_outcomes(get_verifier(name), target, draft, k, 2)
    assert law_error(iteration_law(outcomes, target, draft, 2), target, 3) < TOL
    # with a one-hot target, every method accepts exactly the longest draft prefix matching argmax
    greedy = {o.emitted: o.prob for o in iteration_outcomes(get_verifier("greedy"), target, draft, k, 2)}
    mine = {}
    for o in outcomes:
        mine[o.emitted] = mine.get(o.emitted, 0.0) + o.prob
    assert set(mine) == set(greedy)
    assert all(abs(mine[e] - greedy[e]) < TOL for e in mine)


def test_greedy_verifier_is_not_lossless_on_a_stochastic_target():
    """Negative control: argmax acceptance (EAGLE's evaluate_posterior) is exact only for one-hot q."""
    target, draft = models(4, seed=3)
    outcomes = iteration_outcomes(get_verifier("greedy"), target, draft, 2, 2)
    assert law_error(iteration_law(outcomes, target, draft, 2), target, 3) > 1e-2


def closed_form_token(target, draft, n):
    """E[tau] = sum_i sum_{x^i} prod_j min(p, q)(x_j | x^{j-1})."""
    overlap = lambda y: torch.minimum(target(y), draft(y))  # noqa: E731
    return sum(w for i in range(1, n + 1) for _, w in sequences(overlap, i))


def closed_form_block(target, draft, n):
    """E[tau] = sum_i sum_{x^i} P(x^i) p_i(x^i), p_i the clipped running ratio."""
    total = 0.0
    for i in range(1, n + 1):
        for x, w in sequences(draft, i):
            tq = torch.stack([target(x[:j]) for j in range(i + 1)])
            dp = torch.stack([draft(x[:j]) for j in range(i)])
            total += w * block_ratios(tq, dp, torch.tensor(x))[i]
    return total


def closed_form_gbv(target, draft, n):
    """First-iteration E[tau] = sum_t sum_{x^t} min(P, Q)(x^t)."""
    qs = [dict(sequences(target, i)) for i in range(n + 1)]
    return sum(min(w, qs[i].get(x, 0.0)) for i in range(1, n + 1) for x, w in sequences(draft, i))


@pytest.mark.parametrize("vocab,n", [(4, 2), (5, 3)])
@pytest.mark.parametrize(
    "name,closed_form",
    [
        ("token", closed_form_token),
        ("block", closed_form_block),
        ("greedy_block", closed_form_gbv),
        ("spectr_gbv", closed_form_gbv),
    ],
)
def test_expected_accepted_length_matches_closed_form(name, closed_form, vocab, n):
    target, draft = models(vocab, seed=11 * vocab + n)
    outcomes = iteration_outcomes(get_verifier(name), target, draft, 1, n)
    assert abs(expected_accepted(outcomes) - closed_form(target, draft, n)) < TOL


@pytest.mark.parametrize("k", [2, 3])
def test_kseq_at_one_token_accepts_rho_beta(k):
    """SpecTr K-SEQ at L = 1: E[tau] = 1 - (1 - beta)^k = rho* beta(rho*), rho* the root of g."""
    target, draft = models(5, seed=20 + k)
    q, p = target(()), draft(())
    beta = lambda rho: float(torch.minimum(p, q / rho).sum())  # noqa: E731
    lo, hi = 1.0, float(k)  # an independent, much tighter bisection for the root
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if mid * beta(mid) - 1 + (1 - beta(mid)) ** k >= 0 else (mid, hi)
    tau = expected_accepted(iteration_outcomes(get_verifier("spectr"), target, draft, k, 1))
    assert abs(tau - hi * beta(hi)) < 10 * RHO_TOL
    assert tau >= beta(1.0) - TOL  # at least standard speculative sampling


def test_rgbv_special_cases_and_order():
    """RGBV = GBV at K = 1, = RRS at L = 1; monotone in K; never below GBV; token <= BV <= GBV."""
    target, draft = models(4, seed=5)
    tau = lambda name, k, n: expected_accepted(iteration_outcomes(get_verifier(name), target, draft, k, n))  # noqa: E731
    assert abs(tau("spectr_gbv", 1, 3) - tau("greedy_block", 1, 3)) < TOL
    for k in (2, 3):
        assert abs(tau("spectr_gbv", k, 1) - tau("rrs", k, 1)) < TOL
    by_k = [tau("spectr_gbv", k, 2) for k in (1, 2, 3)]
    assert by_k[0] <= by_k[1] + TOL <= by_k[2] + 2 * TOL
    assert tau("token", 1, 3) <= tau("block", 1, 3) + TOL <= tau("greedy_block", 1, 3) + 2 * TOL


def test_block_verification_toy_example():
    """The BV paper's toy (p = (1/3, 2/3), q = (2/3, 1/3), L = 2): token 10/9, BV 11/9, GBV 12/9."""
    q, p = TableModel(2, fixed=[2 / 3, 1 / 3]), TableModel(2, fixed=[1 / 3, 2 / 3])
    for name, expected in [("token", 10 / 9), ("block", 11 / 9), ("greedy_block", 12 / 9)]:
        assert abs(expected_accepted(iteration_outcomes(get_verifier(name), q, p, 1, 2)) - expected) < TOL


def test_whole_decode_target_calls_on_the_toy_example():
    """Expected target calls to emit H = 7 tokens (docs/verifiers.md section 4): GBV's extra first-iteration
    acceptance is paid back later, so it needs MORE calls than block and even token-wise verification."""
    q, p = TableModel(2, fixed=[2 / 3, 1 / 3]), TableModel(2, fixed=[1 / 3, 2 / 3])
    calls = {}
    for name in ["token", "block", "greedy_block"]:
        result = decode_law(get_verifier(name), q, p, 1, 2, 7)
        assert law_error(result.law, q, 7) < TOL
        calls[name] = result.target_calls
    assert calls["token"] == pytest.approx(3.680, abs=5e-4)
    assert calls["block"] == pytest.approx(3.528, abs=5e-4)
    assert calls["greedy_block"] == pytest.approx(3.705, abs=5e-4)


@pytest.mark.slow
@pytest.mark.parametrize("name,k", [("greedy_block", 1), ("spectr_gbv", 2), ("block", 1), ("rrs", 2)])
def test_whole_decodes_keep_the_target_law(name, k):
    """Several iterations, continuations carried across them (cross-iteration methods)."""
    target, draft = models(4, seed=31, sparsity=0.3 if k > 1 else 0.0)
    result = decode_law(get_verifier(name), target, draft, k, 2, 4)
    assert law_error(result.law, target, 4) < TOL
    assert 1.0 <= result.tokens_per_call <= 3.0


# ----------------------------------------------------------------------------- RGBV reference
def reference_rgbv(target_probs, draft_probs, draft_tokens, generator=None, *, sampler=None):
    """SpecTr-GBV written straight from the general Coupling (every row by prefix, memoised, lazy): the
    form the continuation uses. The registered verifier runs PathCoupling (rows by position, batched
    passes, the set H found from committed tokens); both must give the same outcome law."""
    s, tokens = make_sampler(generator, sampler), draft_tokens.tolist()
    n = len(tokens[0])
    coupling = Coupling(draft_rows(target_probs, draft_probs, tokens), n)

    def weight(path, i):
        j, y = len(coupling.stages), path[:i]
        q_i, p_i = coupling.joint(j, y), coupling.draft_joint(y)
        if q_i <= 0.0:
            return 0.0
        if q_i >= p_i or i == n:
            return min(1.0, q_i / p_i) if p_i > 0 else 1.0
        row = coupling.law(j, y)
        if row.token is not None:
            a = max(q_i - p_i * coupling.rows.p(y, row.token), 0.0)
        else:
            c = q_i / coupling.rows.mass(y, row.lam)
            a = c * coupling.rows.mass(y, coupling.residual_lam(y, row, q_i, p_i))
        return a / (a + p_i - q_i)

    best_k, best_tau = 0, 0
    for k, x in enumerate(tokens):
        tau = backward_scan(s, lambda i, path=tuple(x): weight(path, i), n)
        coupling.stages.append(Stage(tuple(x), tau))
        if tau > best_tau:
            best_k, best_tau = k, tau
        if best_tau == n:
            break
    cont = RGBVContinuation(tuple(coupling.stages), n)
    if best_tau == n:
        return VerifyOutput(n, best_k, s.categorical(target_probs[best_k, n]), cont)
    best = tuple(tokens[best_k][:best_tau])
    return VerifyOutput(
        best_tau, best_k, s.categorical(row_law(coupling.rows, best, coupling.law(k + 1, best))), cont
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "vocab,k,n,sparsity", [(4, 2, 3, 0.4), (4, 3, 2, 0.5), (5, 2, 2, 0.0), (4, 3, 3, 0.6)]
)
def test_fast_rgbv_equals_the_reference_form(vocab, k, n, sparsity):
    """Same outcomes with the same probabilities, continuation included (its key is the stages' accepted
    tokens), for every draft tuple and random path."""
    for seed in (3, 4):
        target, draft = models(vocab, seed=seed, sparsity=sparsity)

        def law(verifier):
            return {
                (o.emitted, o.num_accepted, o.continuation.cache_key()): o.prob
                for o in iteration_outcomes(verifier, target, draft, k, n)
            }

        fast, ref = law(get_verifier("spectr_gbv")), law(reference_rgbv)
        assert set(fast) == set(ref)
        assert max(abs(fast[o] - ref[o]) for o in ref) < 1e-12


def test_committed_reach_finds_the_rejected_sub_blocks():
    stages = [Stage((1, 2, 3), 2), Stage((1, 0, 0), 0)]
    assert committed_reach(stages, (1, 2, 0)) == 3  # follows the committed (1, 2)
    assert committed_reach(stages, (1, 3, 3)) == 1  # leaves it at position 1: dead past (1,)
    assert committed_reach(stages, (0,)) == 0
    assert committed_reach(stages, (1,)) == 1
    assert committed_reach([], (5, 5)) == 2


# ----------------------------------------------------------------------------- negative controls
def bv_with_tokenwise_residual(target_probs, draft_probs, draft_tokens, generator=None, *, sampler=None):
    """Block verification with the bug of vllm-ascend #7807: correction from (q - p)_+."""
    s, x = make_sampler(generator, sampler), draft_tokens[0]
    n, run = x.shape[0], block_ratios(target_probs[0], draft_probs[0], x)
    rows = draft_rows(target_probs, draft_probs, draft_tokens.tolist())
    prefixes = [tuple(x[:i].tolist()) for i in range(n + 1)]

    def weight(i):
        if i == n or not 0.0 < run[i] < 1.0:
            return run[i]
        z = run[i] * rows.mass(prefixes[i], 1.0 / run[i])
        return z / (z + 1.0 - run[i])

    tau = backward_scan(s, weight, n)
    law = target_probs[0, n].to(ACC_DTYPE) if tau == n else rows.residual(prefixes[tau], 1.0)
    return VerifyOutput(tau, 0, s.categorical(law))


def gbv_without_continuation(*args, **kwargs):
    out = get_verifier("greedy_block")(*args, **kwargs)
    return VerifyOutput(out.num_accepted, out.draft_index, out.next_token, None)


def test_negative_control_block_verification_with_tokenwise_residual_fails():
    worst = 0.0
    for seed in range(6):  # the bug shows at V >= 4 (at V <= 3 both residuals often coincide)
        target, draft = models(4, seed=seed)
        outcomes = iteration_outcomes(bv_with_tokenwise_residual, target, draft, 1, 2)
        worst = max(worst, law_error(iteration_law(outcomes, target, draft, 2), target, 3))
    assert worst > 1e-4


def test_negative_control_greedy_block_without_continuation_fails():
    target, draft = models(4, seed=2)
    outcomes = iteration_outcomes(gbv_without_continuation, target, draft, 1, 3)
    assert law_error(iteration_law(outcomes, target, draft, 3), target, 4) > 1e-3
    result = decode_law(gbv_without_continuation, target, draft, 1, 2, 4)
    assert law_error(result.law, target, 4) > 1e-3


def test_every_stochastic_verifier_is_covered():
    from specblock.evaluate.verify import VERIFIERS

    assert set(VERIFIERS) == set(STOCHASTIC) | {"greedy"}
    assert CROSS_ITERATION == {"greedy_block", "spectr_gbv"}


def test_exact_sampler_enumerates_each_path_once():
    from specblock.evaluate.verify.exact import enumerate_outcomes

    def two_coins_and_a_token(s):
        a = s.bernoulli(0.3)
        b = s.first_failure(torch.tensor([0.5, 0.5]))
        return a, b, s.categorical(torch.tensor([1.0, 0.0, 3.0]))

    outcomes = enumerate_outcomes(two_coins_and_a_token)
    assert len(outcomes) == len({o for _, o in outcomes}) == 2 * 3 * 2
    assert abs(sum(w for w, _ in outcomes) - 1.0) < TOL
    probs = {o: w for w, o in outcomes}
    assert probs[(True, 2, 2)] == pytest.approx(0.3 * 0.25 * 0.75)
    assert all(t != 1 for _, (_, _, t) in outcomes)  # zero weight is never drawn


def test_cases_cover_the_required_ranges():
    assert {v for v, *_ in CASES} == {4, 5, 6} and max(n for *_, n, _ in CASES) == 3
    assert max(k for _, k, *_ in CASES) == 3


def test_continuation_shares_rows_between_prefixes_of_the_same_lookups():
    """The decoding loop asks one continuation for many prefixes with the same two lookups: the answers
    equal those of fresh lookups, with fewer reads (ancestors' rows and masses are shared)."""
    target, draft = models(5, seed=8)
    cont = RGBVContinuation((Stage((1, 2, 0), 1), Stage((1, 0, 3), 0), Stage((2, 2, 2), 0)), 3)
    prefixes = [y for y, _ in sequences(target, 2)]
    reads = {"shared": 0, "fresh": 0}

    def counted(kind, model):
        def at(y):
            reads[kind] += 1
            return model(y)

        return at

    shared = (counted("shared", target), counted("shared", draft))
    laws = [cont(y, *shared) for y in prefixes]
    for y, law in zip(prefixes, laws):
        assert torch.allclose(
            cont(y, counted("fresh", target), counted("fresh", draft)), law, atol=1e-15, rtol=0
        )
    assert reads["shared"] < 0.8 * reads["fresh"]  # 71 against 103 reads


def test_kseq_correction_where_float32_cancels():
    """SpecTr K-SEQ on float32 laws (as the loop passes them) with the draft within 2^-23 of a one-hot target:
    both candidates are rejected with probability ~1e-14, where the correction q - m cancels to 0 in float32
    (it used to reach the sampler as an empty law). It is formed in float64 there and the law stays the
    target's. With p = q exactly, rho = 1 and no candidate is ever rejected."""
    from specblock.evaluate.verify.multidraft import kseq_rho

    q = torch.tensor([1.0, 0.0, 0.0, 0.0])
    p = torch.tensor([1.0 - 2**-23, 2**-23, 0.0, 0.0])  # sums to 1 exactly in float32
    outcomes = iteration_outcomes(get_verifier("spectr"), lambda y: q, lambda y: p, 2, 1)
    assert law_error(iteration_law(outcomes, lambda y: q, lambda y: p, 1), lambda y: q, 2) < TOL
    assert min(o.prob for o in outcomes) > 1e-15  # the rejection path was enumerated, not pruned
    rows = draft_rows(q.expand(2, 2, 4), q.expand(2, 1, 4), [[0], [0]])
    assert kseq_rho(rows, (), 2) == (1.0, 1.0)
