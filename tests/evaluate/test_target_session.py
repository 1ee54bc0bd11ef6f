"""The decoding loop's pieces: the target session's tree forward and in-place cache cut (every attention
implementation), draft trees (shared prefixes merged, pruning), the greedy path, and temperature 0
forming no vocabulary laws."""

from __future__ import annotations


import pytest
import torch

from specblock.evaluate.decoding import loop as decode_mod
from specblock.evaluate.decoding.loop import DecodeConfig, SpeculativeDecoder
from specblock.evaluate.decoding.target import TargetSession
from specblock.evaluate.decoding.trees import DraftTree, drafts_tree
from specblock.evaluate.verify import greedy_path

from tiny_decoding import (
    REPEATS,
    PROMPT,
    VOCAB,
)


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
    s.forward([7])  # a plain step kept whole: nothing to cut, the layers stay the tensors they are
    keys = layer.keys
    s.keep(6, [0])
    assert layer.keys is keys and len(s) == 7


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


def test_grouped_attention_is_sdpa_without_the_key_copies(monkeypatch):
    """The session switches a CPU sdpa target to grouped_sdpa (query heads stacked per key head for a few
    masked queries): tree forwards give sdpa's logits, a plain causal call of the model still gets its
    padding mask (a custom attention without a registered mask function would get none), and eager
    attention is left alone."""
    from tiny_models import tiny_llama

    from specblock.data.target import FeatureTarget
    from specblock.evaluate.decoding import target as target_mod

    model = tiny_llama(VOCAB, seed=5, attn_implementation="sdpa")
    assert model.config.num_attention_heads > model.config.num_key_value_heads  # grouped query heads
    ids = [3, 8, 1, 4, 6, 2, 5]
    padded = {"input_ids": torch.tensor([[0] + ids]), "attention_mask": torch.tensor([[0] + [1] * len(ids)])}
    with torch.no_grad():
        full = model(torch.tensor([ids])).logits[0].float()
        left_padded = model(**padded).logits[0].float()
    with monkeypatch.context() as m:  # a session left on plain sdpa, for the tree's reference logits
        m.setattr(target_mod, "use_grouped_attention", lambda model: None)
        ref = TargetSession(FeatureTarget(model))
    assert model.config._attn_implementation == "sdpa"
    ref.reset()
    ref.forward(ids[:4])
    tree_tokens, parents = [ids[4], 9, ids[5], 2, 7], [-1, -1, 0, 2, 0]
    _, want = ref.forward(tree_tokens, parents)

    calls = []
    grouped = target_mod.grouped_sdpa

    def spy(module, query, *args, **kwargs):
        calls.append(query.shape[2])
        return grouped(module, query, *args, **kwargs)

    monkeypatch.setitem(target_mod.AttentionInterface._global_mapping, target_mod.GROUPED_SDPA, spy)
    s = TargetSession(FeatureTarget(model))
    assert model.config._attn_implementation == target_mod.GROUPED_SDPA
    s.reset()
    s.forward(ids[:4])
    _, got = s.forward(tree_tokens, parents)
    assert 5 in calls  # the tree's five queries went through the grouped path
    assert torch.allclose(got, want, atol=1e-5)
    assert torch.allclose(got[0], full[4], atol=1e-5) and torch.allclose(got[2], full[5], atol=1e-5)
    with torch.no_grad():  # a 2-D padding mask still becomes sdpa's mask (registered mask function)
        again = model(**padded).logits[0].float()
    assert torch.allclose(again, left_padded, atol=1e-5)
    eager = tiny_llama(VOCAB, seed=5, attn_implementation="eager")
    TargetSession(FeatureTarget(eager))
    assert eager.config._attn_implementation == "eager"


def test_grouped_attention_hands_unknown_arguments_to_sdpa(monkeypatch):
    """A layer that passes an argument that changes the math (Gemma 2's softcap here) is not attended by
    the grouped path, which would drop it: transformers' sdpa gets the call (and refuses softcap)."""
    from specblock.evaluate.decoding import target as target_mod

    seen = []
    monkeypatch.setattr(
        target_mod, "sdpa_attention_forward", lambda *a, **kw: seen.append(kw) or ("sdpa", None)
    )
    module = torch.nn.Module().eval()
    module.num_key_value_groups = 2
    q, kv = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 5, 8)
    mask = torch.zeros(1, 1, 3, 5)
    assert target_mod.grouped_sdpa(module, q, kv, kv, mask, softcap=30.0)[0] == "sdpa"
    assert seen[-1]["softcap"] == 30.0
    out, _ = target_mod.grouped_sdpa(module, q, kv, kv, mask, position_ids=torch.arange(3)[None])
    assert out.shape == (1, 3, 4, 8) and len(seen) == 1


def test_grouped_mask_is_repeated_once_per_mask():
    """Every layer of a forward passes the same mask: it is repeated once (the same tensor comes back),
    a new mask or one written in place is repeated again, and the rows follow repeat_kv's order."""
    from specblock.evaluate.decoding.target import forget_grouped_mask, grouped_mask

    mask = torch.zeros(1, 1, 2, 4)
    mask[0, 0, 0, 3] = float("-inf")
    first = grouped_mask(mask, 1, 2, 3)
    assert first.shape == (1, 1, 6, 4) and torch.equal(first[0, 0, ::2], mask[0, 0, :1].expand(3, 4))
    assert grouped_mask(mask, 1, 2, 3) is first
    mask[0, 0, 1, 2] = float("-inf")  # written in place: its version changed
    again = grouped_mask(mask, 1, 2, 3)
    assert again is not first and torch.equal(again[0, 0, 1::2], mask[0, 0, 1:].expand(3, 4))
    other = mask.clone()
    assert grouped_mask(other, 1, 2, 3) is not again
    assert grouped_mask(other, 2, 2, 3).shape == (2, 1, 6, 4)  # another batch size
    broadcast = torch.zeros(1, 1, 1, 4)  # one mask row for every query
    assert grouped_mask(broadcast, 1, 2, 3).shape == (1, 1, 6, 4)
    assert grouped_mask(broadcast, 1, 3, 3).shape == (1, 1, 9, 4)  # the same mask, more queries
    kept = grouped_mask(broadcast, 1, 3, 3)
    forget_grouped_mask()  # the cache emptied: the same mask is repeated again
    assert grouped_mask(broadcast, 1, 3, 3) is not kept
