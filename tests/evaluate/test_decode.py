"""The decoding loop: greedy equality with the target's own greedy decoding for every drafting mode and
verifier, and statistical fidelity (the law of generated sequences = the target's) at temperature > 0."""

from __future__ import annotations

import copy
import math
import time

import pytest
import torch

from specblock.evaluate.decoding import loop as decode_mod
from specblock.evaluate.decoding.continuations import LawBook
from specblock.evaluate.decoding.loop import DecodeConfig, SpeculativeDecoder
from specblock.evaluate.decoding.target import TargetSession
from specblock.evaluate.decoding.trees import DraftTree, TreeConfig, drafts_tree
from specblock.evaluate.verify import VerifyOutput, greedy_path
from specblock.evaluate.verify import base as verify_base

from tiny_decoding import (
    HORIZON,
    PROMPT,
    VOCAB,
    OracleRoot,
    drafters,
    exact_law,
    loop_law,
    max_error,
    near_target_law,
    tiny_target,
)

SCHEMES = [  # (mode, verifier, num_drafts)
    ("chain", "token", 1),
    ("chain", "block", 1),
    ("chain", "greedy_block", 1),
    ("iid", "spectr", 3),
    ("iid", "rrs", 3),
    ("iid", "spectr_gbv", 3),
    ("iid", "greedy", 2),
    ("tree", "token", 1),
]


@pytest.fixture(scope="module")
def greedy_setup():
    target = tiny_target(64, 1.0)
    return target, drafters(target)


@pytest.mark.parametrize("drafter", ["specblock", "eagle3"])
@pytest.mark.parametrize("mode,verifier,k", SCHEMES)
def test_greedy_equals_target_greedy(greedy_setup, drafter, mode, verifier, k):
    target, ds = greedy_setup
    tree = TreeConfig(budget=12, steps=2, beam=4, topk=4)
    ar = DecodeConfig(mode="autoregressive", temperature=0.0, max_new_tokens=24)
    for prompt in (PROMPT, [7, 2]):
        ref = SpeculativeDecoder(target, None, ar).generate(prompt)
        cfg = DecodeConfig(mode, verifier, k, 4, temperature=0.0, max_new_tokens=24, tree=tree)
        out = SpeculativeDecoder(target, ds[drafter], cfg).generate(prompt, seed=3)
        assert out.tokens == ref.tokens
        assert out.target_calls == out.prefill_calls + len(out.iterations)
        assert sum(it.emitted for it in out.iterations) + 1 == len(out.tokens)


@pytest.mark.parametrize("drafter", ["specblock", "eagle3"])
def test_auto_tree_budget_keeps_greedy_equality(greedy_setup, drafter):
    """The probe forwards leave the KV cache as they found it and count no call; any subtree the choice
    keeps is a valid draft tree, so the output is the target's greedy decoding."""
    target, ds = greedy_setup
    ar = DecodeConfig(mode="autoregressive", temperature=0.0, max_new_tokens=20)
    tree = TreeConfig(budget="auto", max_budget=12, steps=2, beam=4, topk=4)
    dec = SpeculativeDecoder(
        target, ds[drafter], DecodeConfig("tree", temperature=0.0, max_new_tokens=20, tree=tree)
    )
    for prompt in (PROMPT, [7, 2]):
        ref = SpeculativeDecoder(target, None, ar).generate(prompt)
        out = dec.generate(prompt)
        assert out.tokens == ref.tokens
        assert out.target_calls == out.prefill_calls + len(out.iterations)
    assert dec.auto.curve is not None and dec.calibration_seconds > 0
    assert dec.auto.curve.sizes[-1] == 13 and len(dec.auto.chosen) == dec.auto.iterations
    assert all(1 <= b <= 12 for b in dec.auto.chosen)


def test_greedy_equality_with_an_accurate_drafter(greedy_setup):
    """A drafter that copies the target's greedy choices (through a wrapper) gets whole blocks
    accepted: the accepted paths, the kept KV entries and the bonus tokens all go through."""
    target, ds = greedy_setup
    ar = DecodeConfig(mode="autoregressive", temperature=0.0, max_new_tokens=20)
    ref = SpeculativeDecoder(target, None, ar).generate(PROMPT).tokens
    oracle = OracleRoot.install(target, PROMPT, ref)
    try:
        for mode, verifier, k in [("chain", "block", 1), ("iid", "spectr_gbv", 2), ("tree", "token", 1)]:
            cfg = DecodeConfig(mode, verifier, k, 3, temperature=0.0, max_new_tokens=20)
            dec = SpeculativeDecoder(target, ds["eagle3"], cfg)
            out = dec.generate(PROMPT)
            assert out.tokens == ref
            assert sum(it.accepted for it in out.iterations) >= len(ref) // 2, (mode, out.iterations)
    finally:
        oracle.uninstall()


# ---------------------------------------------------------------- statistical fidelity

SAMPLES = 1200


def chi_square_pvalue(counts: dict[tuple, int], law: dict[tuple, float], n: int) -> float:
    """Pearson chi-square of the sample counts against the exact law, cells with expected count < 5
    pooled into one; p-value from the Wilson-Hilferty normal approximation."""
    stat, df, pool_e, pool_o = 0.0, -1, 0.0, 0
    for seq, p in law.items():
        e, o = n * p, counts.get(seq, 0)
        if e >= 5:
            stat += (o - e) ** 2 / e
            df += 1
        else:
            pool_e, pool_o = pool_e + e, pool_o + o
    if pool_e > 0:
        stat += (pool_o - pool_e) ** 2 / pool_e
        df += 1
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


@pytest.fixture(scope="module")
def fidelity_setup():
    target = tiny_target(VOCAB, 25.0, seed=2)
    return target, drafters(target, seed=3)


def sample_counts(target, drafter, cfg: DecodeConfig) -> dict[tuple, int]:
    dec = SpeculativeDecoder(target, drafter, cfg)
    counts: dict[tuple, int] = {}
    for seed in range(SAMPLES):
        seq = tuple(dec.generate(PROMPT, seed=seed).tokens)
        counts[seq] = counts.get(seq, 0) + 1
    return counts


FIDELITY = [  # (drafter, mode, verifier, K, L, temperature, top_p)
    ("specblock", "chain", "token", 1, 2, 1.0, 1.0),
    ("specblock", "chain", "block", 1, 2, 0.7, 0.9),
    ("specblock", "chain", "greedy_block", 1, 2, 1.0, 1.0),
    ("eagle3", "chain", "greedy_block", 1, 2, 1.0, 1.0),
    ("specblock", "iid", "spectr", 2, 2, 1.0, 1.0),
    ("eagle3", "iid", "rrs", 3, 2, 0.7, 1.0),
    ("specblock", "iid", "spectr_gbv", 2, 2, 1.0, 1.0),
    ("eagle3", "iid", "spectr_gbv", 2, 2, 0.4, 1.0),
    ("specblock", "tree", "token", 1, 2, 1.0, 1.0),
    ("eagle3", "tree", "token", 1, 2, 0.7, 0.9),
    (None, "autoregressive", "token", 1, 2, 1.0, 1.0),
]


@pytest.mark.slow
@pytest.mark.parametrize("drafter,mode,verifier,k,length,temperature,top_p", FIDELITY)
def test_generated_law_matches_target(fidelity_setup, drafter, mode, verifier, k, length, temperature, top_p):
    target, ds = fidelity_setup
    tree = TreeConfig(budget=8, steps=2, beam=3, topk=3)
    cfg = DecodeConfig(mode, verifier, k, length, temperature, top_p, max_new_tokens=HORIZON, tree=tree)
    counts = sample_counts(target, ds.get(drafter), cfg)
    assert chi_square_pvalue(counts, exact_law(target, temperature, top_p), SAMPLES) > 1e-4


@pytest.mark.slow
def test_fidelity_check_catches_a_lossy_verifier(fidelity_setup, monkeypatch):
    """Negative control: a verifier that accepts every draft token outputs the draft's law, and the
    same statistic rejects it."""
    target, ds = fidelity_setup

    def accept_all(target_probs, draft_probs, draft_tokens, generator=None, *, sampler=None):
        L = draft_tokens.shape[1]
        nxt = sampler.categorical(target_probs[0, L])
        return VerifyOutput(L, 0, nxt)

    monkeypatch.setitem(verify_base.VERIFIERS, "accept_all", accept_all)
    cfg = DecodeConfig("chain", "accept_all", 1, 2, 1.0, max_new_tokens=HORIZON)
    counts = sample_counts(target, ds["specblock"], cfg)
    assert chi_square_pvalue(counts, exact_law(target, 1.0, 1.0), SAMPLES) < 1e-6


# ---------------------------------------------------------------- pieces


def test_target_session_tree_forward_matches_plain_forward(greedy_setup):
    target, _ = greedy_setup
    ids = [3, 8, 1, 4, 6, 2]
    with torch.no_grad():
        full = target.model(torch.tensor([ids])).logits[0].float()
    s = TargetSession(target)
    s.reset()
    s.forward(ids[:3])
    # root ids[3], then a tree: node1 = ids[4] (child of root), node2 = 9 (child of root), node3 = ids[5]
    _, logits = s.forward([ids[3], ids[4], 9, ids[5]], [-1, 0, 0, 1])
    assert torch.allclose(logits[0], full[3], atol=1e-5)
    assert torch.allclose(logits[1], full[4], atol=1e-5)
    assert torch.allclose(logits[3], full[5], atol=1e-5)
    s.keep(3, [0, 1, 3])  # keep root, node1, node3: the cache now equals ids[:6]
    assert len(s) == 6
    _, nxt = s.forward([7])
    with torch.no_grad():
        ref = target.model(torch.tensor([ids + [7]])).logits[0, -1].float()
    assert torch.allclose(nxt[0], ref, atol=1e-5)


def test_target_session_keep_cuts_in_place(greedy_setup):
    """keep moves the kept entries down in place and cuts each layer to a view (no copy of the cache);
    offsets that are not a path (not ascending) are refused."""
    target, _ = greedy_setup
    s = TargetSession(target)
    s.reset()
    s.forward([3, 8, 1])
    s.forward([4, 6, 9, 2], [-1, 0, 0, 2])
    layer = s.cache.layers[0]
    before, pointer = layer.keys.clone(), layer.keys.data_ptr()
    s.keep(3, [0, 2, 3])
    assert layer.keys.data_ptr() == pointer and len(s) == 6
    assert torch.equal(layer.keys, before[..., [0, 1, 2, 3, 5, 6], :])
    with pytest.raises(ValueError, match="ascending"):
        s.keep(3, [1, 0])


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_target_session_is_right_under_every_attention_implementation(attn):
    """The session's 4-D tree mask must mean the same to every implementation: a boolean mask was read
    as "True = attend" by sdpa but added to the scores by eager attention (which then masked nothing:
    the prefill saw future tokens, and the loop's target, the autoregressive baseline included, was
    another model that greedy equality could not notice)."""
    from tiny_models import tiny_llama

    from specblock.data.target import FeatureTarget

    model = tiny_llama(VOCAB, seed=3, attn_implementation=attn)
    assert model.config._attn_implementation == attn
    ids = [3, 8, 1, 4, 6, 2, 5]
    with torch.no_grad():
        full = model(torch.tensor([ids])).logits[0].float()
    s = TargetSession(FeatureTarget(model))
    s.reset()
    _, prefill = s.forward(ids[:4])
    assert torch.allclose(prefill, full[:4], atol=1e-5)
    _, logits = s.forward([ids[4], 9, ids[5]], [-1, -1, 0])  # two children of the cache's last token
    assert torch.allclose(logits[0], full[4], atol=1e-5) and torch.allclose(logits[2], full[5], atol=1e-5)


def test_drafts_tree_merges_shared_prefixes():
    tree, nodes = drafts_tree([[5, 6, 7], [5, 6, 8], [4, 6, 7]])
    assert len(tree) == 1 + 4 + 3  # 5, 6, 7, 8 | 4, 6, 7
    assert nodes[0][:3] == nodes[1][:3] and nodes[0][3] != nodes[1][3]
    assert tree.path_tokens(nodes[2][3]) == (4, 6, 7)


def test_tree_pruning_keeps_best_nodes_and_ancestors():
    t = DraftTree()
    a = t.add(0, 1, -0.1)
    b = t.add(a, 2, -0.5)
    t.add(0, 3, -0.3)
    t.add(b, 4, -0.6)
    pruned, old = t.pruned(3)
    assert old == [0, 1, 2, 3] and pruned.tokens[1:] == [1, 2, 3]
    assert all(p < n for n, p in enumerate(pruned.parents) if n)


def test_greedy_path_follows_the_argmax_down_the_tree():
    t = DraftTree()
    a, b = t.add(0, 5, 0.0), t.add(0, 6, 0.0)  # root children 5 and 6
    c = t.add(b, 7, 0.0)  # 6 -> 7
    logits = torch.zeros(len(t), 10)
    logits[0, 6] = logits[b, 7] = logits[c, 2] = 1.0  # argmax path: 6, 7, then 2 (no such child: next)
    assert greedy_path(t, logits) == ([b, c], 2)
    logits[0, 6], logits[0, 9] = 0.0, 3.0  # the root's argmax 9 is no child: nothing accepted
    assert greedy_path(t, logits) == ([], 9)
    assert a == 1


def test_temperature_zero_forms_no_vocabulary_laws(greedy_setup, monkeypatch):
    """At temperature 0 neither sampling nor verification calls next_token_law (whose [N, V] rows the
    verifiers would copy to float64): only argmaxes are read."""
    target, ds = greedy_setup

    def forbidden(*args, **kwargs):
        raise AssertionError("next_token_law called at temperature 0")

    monkeypatch.setattr(decode_mod, "next_token_law", forbidden)
    for mode, verifier, k in [("chain", "token", 1), ("iid", "spectr_gbv", 2), ("tree", "token", 1)]:
        cfg = DecodeConfig(mode, verifier, k, 3, temperature=0.0, max_new_tokens=8)
        assert len(SpeculativeDecoder(target, ds["eagle3"], cfg).generate(PROMPT).tokens) == 8
    lookup = DecodeConfig("lookup", draft_length=3, temperature=0.0, max_new_tokens=8)
    assert len(SpeculativeDecoder(target, None, lookup).generate(REPEATS).tokens) == 8


def test_decode_config_errors():
    with pytest.raises(ValueError, match="mode"):
        DecodeConfig(mode="beam")
    with pytest.raises(ValueError, match="single draft"):
        DecodeConfig(mode="iid", verifier="block", num_drafts=2)
    with pytest.raises(ValueError, match="num_drafts=1"):
        DecodeConfig(mode="chain", verifier="token", num_drafts=2)
    with pytest.raises(ValueError, match="lookup"):
        DecodeConfig(mode="lookup", verifier="block")


# ---------------------------------------------------------------- exact law of the real loop


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


@pytest.mark.slow
def test_exact_law_of_the_loop_with_continuations(exact_setup):
    """greedy_block through the real loop (KV caches, tree forward, LawBook continuations): the law of
    three generated tokens equals the target's to float precision; with the continuation dropped it
    does not (the negative control that the sampled fidelity test is too coarse to see)."""
    target, ds = exact_setup
    ref = exact_law(target, 1.0, 0.5)
    cfg = DecodeConfig("chain", "greedy_block", 1, 2, 1.0, 0.5, max_new_tokens=HORIZON)
    assert max_error(loop_law(target, ds["specblock"], cfg), ref) < 1e-6
    assert max_error(loop_law(target, ds["specblock"], cfg, carry=False), ref) > 1e-3


def frozen_auto(monkeypatch, ms_per_token: float):
    """The auto length's choice made deterministic (exact enumeration replays the loop many times): a
    fixed forward curve, no online updates of c, the fixed cost or the drafting cost."""
    from specblock.evaluate.decoding import budget

    curve = budget.ForwardCurve([1, 64], [10.0, 10.0 + 63 * ms_per_token])
    monkeypatch.setattr(budget, "measure_forward_curve", lambda probe, grid: curve)
    monkeypatch.setattr(decode_mod, "measure_forward_curve", lambda probe, grid: curve)
    monkeypatch.setattr(budget.AutoBudget, "observe", lambda self, *a: None)
    monkeypatch.setattr(budget.AutoBudget, "observe_drafting", lambda self, *a: None)


def test_exact_law_of_auto_draft_length(exact_setup, monkeypatch):
    """draft_length=auto at temperature > 0: drafting stops on the tokens before, never cutting a drafted
    token on its own value, so the law of generations is the target's. (Cutting after seeing, as at
    temperature 0, is biased in general: V = 2, p = (.5, .5), q = (.9, .1), keep x only if x = 1 gives
    (.85, .15). On this target's top-p laws the cut rarely depends on the value: an error of 5e-8 only,
    so it is not used as a negative control here.)"""
    target, ds = exact_setup
    frozen_auto(monkeypatch, ms_per_token=4.0)  # a forward that grows: chains of 1-3 tokens
    ref = exact_law(target, 1.0, 0.5)
    cfg = DecodeConfig("chain", "token", 1, 3, 1.0, 0.5, max_new_tokens=HORIZON, auto_length=True)
    lengths = []
    choose = decode_mod.AutoBudget.draft_more
    monkeypatch.setattr(
        decode_mod.AutoBudget, "draft_more", lambda self, c: lengths.append(len(c)) or choose(self, c)
    )
    assert max_error(loop_law(target, ds["eagle3"], cfg), ref) < 1e-6
    assert 1 in lengths and 2 in lengths  # the rule stopped early and went on, depending on the draft


@pytest.mark.parametrize("drafter", ["specblock", "eagle3"])
@pytest.mark.parametrize("ms_per_token, length", [(0.0, 6), (50.0, 1)])
def test_auto_draft_length_keeps_greedy_equality(greedy_setup, drafter, ms_per_token, length, monkeypatch):
    """Free width drafts whole chains of max length, expensive width one token; both exact."""
    target, ds = greedy_setup
    frozen_auto(monkeypatch, ms_per_token)
    ar = DecodeConfig(mode="autoregressive", temperature=0.0, max_new_tokens=20)
    cfg = DecodeConfig("chain", "token", 1, 6, 0.0, max_new_tokens=20, auto_length=True)
    dec = SpeculativeDecoder(target, ds[drafter], cfg)
    for prompt in (PROMPT, [7, 2]):
        assert dec.generate(prompt).tokens == SpeculativeDecoder(target, None, ar).generate(prompt).tokens
    assert dec.auto.chosen and set(dec.auto.chosen) == {length}


@pytest.mark.parametrize("drafter, depth", [("specblock", 3), ("eagle3", 1)])
def test_auto_tree_stops_drafting_rounds_that_cannot_pay(greedy_setup, drafter, depth, monkeypatch):
    """With drafter rounds known to cost a second each, budget=auto drafts the first round only (the
    root's own: EAGLE-3's first step, SpecBlock's first block of 3 slots) and stays exact."""
    target, ds = greedy_setup
    frozen_auto(monkeypatch, ms_per_token=0.0)
    tree = TreeConfig(budget="auto", max_budget=12, steps=3, beam=4, topk=4)
    dec = SpeculativeDecoder(
        target, ds[drafter], DecodeConfig("tree", temperature=0.0, max_new_tokens=20, tree=tree)
    )
    dec.auto.rounds, dec.auto.round_total_ms = 1, 1000.0
    ar = DecodeConfig(mode="autoregressive", temperature=0.0, max_new_tokens=20)
    for prompt in (PROMPT, [7, 2]):
        out = dec.generate(prompt)
        assert out.tokens == SpeculativeDecoder(target, None, ar).generate(prompt).tokens
        assert all(it.draft_len <= depth for it in out.iterations)
        assert all(it.drafter_calls == 1 for it in out.iterations[:-1])  # the advance only


def test_specblock_round_starts_blocks_from_the_leaves_the_budget_keeps(greedy_setup, monkeypatch):
    """budget=auto: the second block round starts blocks only from the leaves `more_rounds` counts (the
    likeliest first), one drafter row each, and the decoding stays exact."""
    from specblock.evaluate.decoding import budget, drafters

    target, ds = greedy_setup
    frozen_auto(monkeypatch, ms_per_token=0.0)
    monkeypatch.setattr(budget.AutoBudget, "more_rounds", lambda self, scores, frontier: 2)
    rows = []
    next_blocks = drafters._next_blocks
    monkeypatch.setattr(
        drafters,
        "_next_blocks",
        lambda r, t, b, leaves: rows.append(len(leaves)) or next_blocks(r, t, b, leaves),
    )
    tree = TreeConfig(budget="auto", max_budget=12, steps=2, beam=4, topk=4)
    dec = SpeculativeDecoder(
        target, ds["specblock"], DecodeConfig("tree", temperature=0.0, max_new_tokens=16, tree=tree)
    )
    ar = DecodeConfig(mode="autoregressive", temperature=0.0, max_new_tokens=16)
    assert dec.generate(PROMPT).tokens == SpeculativeDecoder(target, None, ar).generate(PROMPT).tokens
    assert rows and set(rows) == {2}


def test_auto_draft_length_is_refused_where_the_length_is_a_horizon():
    for mode, verifier, k in (("iid", "spectr", 2), ("chain", "greedy_block", 1), ("tree", "token", 1)):
        with pytest.raises(ValueError, match="draft_length=auto"):
            DecodeConfig(mode, verifier, k, 4, auto_length=True)


# ---------------------------------------------------------------- prompt lookup (no drafter)

REPEATS = [3, 3, 4, 3, 3, 4, 3]  # prompts with repeated spans, so lookup finds drafts from the start
LOOKUP_PROMPTS = [PROMPT, [7, 2], REPEATS, [1, 2, 5, 1, 2, 5, 1]]
# (5, 9, 3), then the 24-token target's greedy continuation of it, then (5, 9, 3) again: the first
# iteration drafts that continuation, which the target often (not always) samples
LOOKUP_PROMPT = [5, 9, 3, 11, 12, 7, 23, 5, 9, 3]


def test_lookup_greedy_equals_target_greedy(greedy_setup):
    target, _ = greedy_setup
    ar = DecodeConfig(mode="autoregressive", temperature=0.0, max_new_tokens=24)
    accepted = 0
    for prompt in LOOKUP_PROMPTS:
        ref = SpeculativeDecoder(target, None, ar).generate(prompt)
        cfg = DecodeConfig("lookup", draft_length=4, temperature=0.0, max_new_tokens=24)
        out = SpeculativeDecoder(target, None, cfg).generate(prompt)
        assert out.tokens == ref.tokens
        assert out.target_calls == out.prefill_calls + len(out.iterations)
        assert all(it.drafter_calls == 0 for it in out.iterations) and out.prefill_drafter_calls == 0
        accepted += sum(it.accepted for it in out.iterations)
    assert accepted >= 10  # the random target loops, and lookup drafts its loops


@pytest.mark.parametrize("temperature,top_p", [(1.0, 0.5), (0.7, 0.5)])
def test_exact_law_of_lookup_decoding(temperature, top_p):
    """Lookup through the real loop (token verifier with a point-mass draft, plain target steps where
    nothing matches): the law of three generated tokens equals the target's, with drafts accepted in a
    good part of the outcomes; a verifier that accepts every draft token is caught (negative control)."""
    target, prompt = tiny_target(VOCAB, 12.0, seed=2), LOOKUP_PROMPT
    cfg = DecodeConfig("lookup", draft_length=2, temperature=temperature, top_p=top_p, max_new_tokens=HORIZON)
    ref, accepted = exact_law(target, temperature, top_p, prompt), []
    law = loop_law(target, None, cfg, prompt=prompt, accepted=accepted)
    assert max_error(law, ref) < 1e-6  # float32 forwards of different shapes
    assert sum(accepted) > 0.1  # P(some draft token accepted): 0.22 at T = 1, 0.16 at T = 0.7


def test_exact_law_of_lookup_catches_a_lossy_verifier(monkeypatch):
    target, prompt = tiny_target(VOCAB, 12.0, seed=2), LOOKUP_PROMPT

    def accept_all(target_probs, draft_probs, draft_tokens, generator=None, *, sampler=None):
        L = draft_tokens.shape[1]
        return VerifyOutput(L, 0, sampler.categorical(target_probs[0, L]))

    monkeypatch.setitem(verify_base.VERIFIERS, "token", accept_all)
    cfg = DecodeConfig("lookup", draft_length=2, temperature=1.0, top_p=0.5, max_new_tokens=HORIZON)
    assert max_error(loop_law(target, None, cfg, prompt=prompt), exact_law(target, 1.0, 0.5, prompt)) > 1e-3


# ---------------------------------------------------------------- the continuation's costs


def test_continuation_draft_laws_come_prefetched_and_count_as_drafting(greedy_setup, monkeypatch):
    """SpecTr-GBV with EAGLE-3 at T > 0: the continuation reads the old root's draft laws beyond the old
    drafts. They are computed before the laws are asked for, in batched drafter calls (none happens inside
    LawBook.law), and their time counts as drafting only: an iteration's drafting + target + verification
    never exceeds its wall time (each drafter call here sleeps 20 ms, so double counting would show)."""
    target, ds = greedy_setup
    inside = {"law": 0, "prefetch": 0}

    def counting(name, fn):
        def wrapped(book, *args):
            dec_calls = dec.drafter.cost.calls
            out = fn(book, *args)
            inside[name] += dec.drafter.cost.calls - dec_calls
            return out

        return wrapped

    drafter = copy.deepcopy(ds["eagle3"])
    with torch.no_grad():  # a worse drafter: blocks rejected in part, so continuations stay in force
        drafter.lm_head.weight.add_(
            torch.randn(drafter.lm_head.weight.shape, generator=torch.Generator().manual_seed(0))
        )
    step = drafter.draft
    drafter.draft = lambda *a, **k: time.sleep(0.02) or step(*a, **k)  # inside the drafter's timer
    cfg = DecodeConfig("iid", "spectr_gbv", 3, 3, 1.0, max_new_tokens=12)
    dec = SpeculativeDecoder(target, drafter, cfg)
    monkeypatch.setattr(LawBook, "law", counting("law", LawBook.law))
    monkeypatch.setattr(LawBook, "prefetch", counting("prefetch", LawBook.prefetch))
    g = dec.generate(PROMPT, seed=0)
    assert inside["prefetch"] > 0 and inside["law"] == 0
    for it in g.iterations:
        assert it.drafter_seconds + it.target_seconds + it.verify_seconds <= it.seconds + 1e-6

    monkeypatch.setattr(LawBook, "prefetch", lambda book, queries: None)  # the negative control
    inside.update(law=0)
    dec.generate(PROMPT, seed=0)
    assert inside["law"] > 0


def test_specblock_draft_laws_are_formed_once_per_slot(greedy_setup, monkeypatch):
    """Within a block a SpecBlock slot's law does not depend on the sampled tokens before it: the [V] law
    is formed once per (block, slot), not once per prefix."""
    from specblock.evaluate.decoding import drafting

    target, ds = greedy_setup
    formed = []
    column = drafting.column_law
    monkeypatch.setattr(drafting, "column_law", lambda *a: formed.append(1) or column(*a))
    cfg = DecodeConfig("iid", "spectr", 4, 3, 1.0, max_new_tokens=2)  # one iteration: 4 drafts in one block
    g = SpeculativeDecoder(target, ds["specblock"], cfg).generate(PROMPT, seed=0)
    assert len(g.iterations) == 1 and len(formed) == 3  # one law per slot (block_size 3), not per prefix
