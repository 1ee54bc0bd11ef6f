"""The decoding loop: greedy equality with the target's own greedy decoding for every drafting mode and
verifier, and statistical fidelity (the law of generated sequences = the target's) at temperature > 0."""

from __future__ import annotations

import copy
import math
import time

import pytest
import torch

from specblock.data.hardware import set_weight_layout
from specblock.data import packed
from specblock.data.packed import PackedLinear, bf16_packing_available, packing_available
from specblock.data.target import FeatureTarget
from specblock.evaluate.decoding.continuations import LawBook
from specblock.evaluate.decoding.loop import DecodeConfig, SpeculativeDecoder
from specblock.evaluate.decoding.trees import TreeConfig
from specblock.evaluate.verify import VerifyOutput
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


@pytest.mark.parametrize("layout", ["column", "packed", "transposed"])
def test_other_weight_layouts_keep_greedy_equality(greedy_setup, layout, monkeypatch):
    """weight_layout=column (data/hardware.py) stores every linear weight transposed, `packed` gives every
    linear an MKL-packed copy, `transposed` multiplies as (W x^T)^T (data/packed.py): the same values
    through another kernel, so plain decoding in that layout is the reference, and every drafting mode over
    a target and drafters in that layout reproduces it."""
    if layout == "packed" and not packing_available():
        pytest.skip("this PyTorch build has no MKL packed product")
    transposed = []  # the rows of every product the transposed kernel served
    real = packed.transposed_linear
    monkeypatch.setattr(packed, "transposed_linear", lambda x, *a: transposed.append(x.shape) or real(x, *a))
    target, ds = greedy_setup
    col = FeatureTarget(copy.deepcopy(target.model), target.feature_layers)
    assert set_weight_layout(col.model, layout) > 0
    ar = DecodeConfig(mode="autoregressive", temperature=0.0, max_new_tokens=24)
    tree = TreeConfig(budget=12, steps=2, beam=4, topk=4)
    for name, drafter in ds.items():
        drafter = copy.deepcopy(drafter)
        assert set_weight_layout(drafter, layout) > 0
        for prompt in (PROMPT, [7, 2]):
            ref = SpeculativeDecoder(col, None, ar).generate(prompt).tokens
            for mode, verifier, k in [("tree", "token", 1), ("chain", "block", 1), ("iid", "spectr_gbv", 3)]:
                cfg = DecodeConfig(mode, verifier, k, 4, temperature=0.0, max_new_tokens=24, tree=tree)
                assert SpeculativeDecoder(col, drafter, cfg).generate(prompt, seed=3).tokens == ref, (
                    name,
                    mode,
                )
    if layout == "packed":  # the packed product ran (in the target and in the drafters)
        assert all(m._pack is not None for m in col.model.modules() if isinstance(m, PackedLinear))
    assert bool(transposed) == (layout == "transposed")  # the tree's and the blocks' products took it


@pytest.mark.skipif(not bf16_packing_available(), reason="no oneDNN bf16 packed product here")
def test_bf16_packed_layout_decodes_as_the_row_layout(greedy_setup):
    """weight_layout=packed-bfloat16 (data/packed.py): oneDNN's product over a packed copy, the same kernel
    F.linear calls on bf16 without the per-call reorder. A bf16 target and drafters decode in it as in the
    row layout (plain decoding and a tree), and the packed product ran in both."""
    target, ds = greedy_setup
    ar = DecodeConfig(mode="autoregressive", temperature=0.0, max_new_tokens=16)
    tree = DecodeConfig(
        "tree", temperature=0.0, max_new_tokens=16, tree=TreeConfig(budget=8, steps=2, beam=4, topk=4)
    )
    outs = {}
    for layout in ("row", "packed-bfloat16"):
        half = FeatureTarget(copy.deepcopy(target.model).bfloat16(), target.feature_layers)
        drafter = copy.deepcopy(ds["specblock"]).bfloat16()
        for module in (half.model, drafter):
            set_weight_layout(module, layout)
        outs[layout] = [
            (
                SpeculativeDecoder(half, None, ar).generate(p).tokens,
                SpeculativeDecoder(half, drafter, tree).generate(p).tokens,
            )
            for p in (PROMPT, [7, 2])
        ]
        if layout != "row":
            for module in (half.model, drafter):
                assert all(m._pack is not None for m in module.modules() if isinstance(m, PackedLinear))
    assert outs["packed-bfloat16"] == outs["row"]


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


# (drafter, mode, verifier, K, L, temperature, top_p). The loops whose law of whole generations is also
# enumerated exactly are not sampled again here (~18 s a case): chain token (test_auto_sizes), chain
# greedy_block over 3 tokens (test_exact_law_of_the_loop_with_continuations), iid SpecTr (test_columns),
# the tree's verification inside tree+lookup (test_tree_lookup).
FIDELITY = [
    ("specblock", "chain", "block", 1, 2, 0.7, 0.9),
    ("eagle3", "iid", "rrs", 3, 2, 0.7, 1.0),
    ("specblock", "iid", "spectr_gbv", 2, 2, 1.0, 1.0),
    ("eagle3", "iid", "spectr_gbv", 2, 2, 0.4, 1.0),
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
