"""The drafters' inference paths equal their training forward: SpecBlock's draft and blocks (cross-block
inheritance, draft caches over shared rows, decoding attention), EAGLE-3's TTT causality and draft."""

import pytest
import torch

from specblock.train.modeling import DraftCache, shift_left
from specblock.train.modeling.specblock import block_offsets

from tiny_drafters import B, T, make, perturbed_fusion, same


# ---------------------------------------------------------------- SpecBlock inference and blocks


def test_specblock_draft_matches_the_training_forward():
    drafter, _, feats, ids = make("specblock", "h48")
    with torch.no_grad():
        drafter.shift_proj[0].weight.normal_(std=0.2)
    out, past = drafter(feats, ids), None
    for t in range(T):
        logits, hidden, rank, past = drafter.draft(feats[:, t], ids[:, t], past, position=t)
        assert same(logits, out.logits[:, t]) and same(hidden, out.hidden[:, t])
        assert same(rank, out.rank_logits[:, t])
    assert len(past) == T * 4
    prefill = drafter.extend(feats[:, :4], ids[:, :4])  # several positions in one call
    rest = drafter.extend(feats[:, 4:], ids[:, 4:], prefill.cache, position=4)
    assert same(prefill.logits, out.logits[:, :4]) and same(rest.logits, out.logits[:, 4:])


@pytest.mark.parametrize("name", ["specblock", "eagle3"])
def test_extend_last_only_gives_the_last_position_and_the_whole_cache(name):
    """What the decoding loop appends with: heads over the last position only, every entry cached."""
    drafter, _, feats, ids = make(name)
    with torch.no_grad():
        full = drafter.extend(feats[:, :5], ids[:, :5])
        last = drafter.extend(feats[:, :5], ids[:, :5], last_only=True)
    assert last.logits.shape[1] == last.hidden.shape[1] == 1
    assert same(last.logits[:, 0], full.logits[:, -1]) and same(last.hidden[:, 0], full.hidden[:, -1])
    if name == "specblock":
        assert same(last.rank_logits[:, 0], full.rank_logits[:, -1])
    assert len(last.cache) == len(full.cache)
    for i in range(len(drafter.layers) if name == "specblock" else 1):
        for a, b in zip(last.cache.layer(i), full.cache.layer(i)):
            assert torch.equal(a, b)


@pytest.mark.parametrize("slots", [[0], [3], [1, 2], [2, 0]])
def test_cross_block_inheritance_matches_inference(slots):
    """forward_blocks (training) == block-by-block drafting with the cache cropped to the source slot."""
    drafter, _, feats, ids = make("specblock")
    K = 4
    blocks, offsets = drafter(feats, ids, None, source_slots=slots), block_offsets(slots)
    for t in range(T):
        past = None
        for tp in range(t):
            past = drafter.draft(feats[:, tp], ids[:, tp], past, position=tp).cache
        _, hidden, _, past = drafter.draft(feats[:, t], ids[:, t], past, position=t)
        for b, m in enumerate(slots, start=1):
            past = past.crop(len(past) - K + m + 1)  # the source block up to slot m stays visible
            token = shift_left(ids, offsets[b])[:, t]
            logits, hidden, _, past = drafter.draft(
                hidden[:, m], token, past, position=t, offset=offsets[b], inherited=True
            )
            assert same(logits, blocks[b].logits[:, t]), (t, b)


def test_next_block_depends_on_its_source_slot_only():
    drafter, _, feats, ids = make("specblock")
    base = drafter.forward_blocks(feats, ids, None, [1])
    assert not same(drafter.forward_blocks(feats, ids, None, [2])[1].logits, base[1].logits)
    with perturbed_fusion(drafter, [(3, 2)], calls=(0,)):  # block 1, position 3, a slot after m = 1
        out = drafter.forward_blocks(feats, ids, None, [1])
    assert same(out[1].logits[:, : 3 + 1], base[1].logits[:, : 3 + 1])
    assert not same(out[1].logits[:, 4], base[1].logits[:, 4])  # a later position sees all of block 1 at 3


def test_draft_cache_rows_and_visibility():
    drafter, _, feats, ids = make("specblock")
    past = drafter.extend(feats[:, :3], ids[:, :3]).cache
    leaves = past.rows(torch.tensor([0, 0, 1]))
    assert len(leaves) == 12 and leaves.keys[0].shape[0] == 3
    hidden = DraftCache(leaves.keys, leaves.values, torch.ones(3, 12, dtype=torch.bool))
    hidden.visible[:, 4:] = False  # hiding entries == cropping them
    a = drafter.draft(feats[[0, 0, 1], 3], ids[[0, 0, 1], 3], hidden, position=3).logits
    b = drafter.draft(feats[[0, 0, 1], 3], ids[[0, 0, 1], 3], leaves.crop(4), position=3).logits
    assert same(a, b)


@pytest.mark.parametrize("name", ["specblock", "eagle3"])
def test_draft_over_shared_rows_equals_copied_rows(name):
    """Leaves that share one stored cache (DraftCache.shared: a visibility row each, the entries once)
    draft what the same leaves draft from copies of the cache, and so do the blocks started from them
    (append_rows: each row sees its own new entries only)."""
    drafter, _, feats, ids = make(name)
    past = drafter.extend(feats[:1, :3], ids[:1, :3]).cache  # batch 1
    rows = past.rows(torch.tensor([0, 0, 0]))
    assert rows.shared() and rows.keys[0] is past.keys[0]
    vis = rows.visible.clone()
    vis[1, -1], vis[2, :2] = False, False  # the rows hide different entries
    shared = DraftCache(past.keys, past.values, vis)
    copied = shared.unshared()  # what a drafter that does not run shared rows itself would draft from
    assert not copied.shared() and copied.keys[0].shape[0] == 3
    with pytest.raises(ValueError, match="unshared"):  # the plain path refuses a shared cache by name
        shared.key_mask(torch.ones(1, 1, 1, 1, dtype=torch.bool))
    where, position = torch.tensor([3, 3, 4]), torch.tensor([3, 3, 4])
    a = drafter.draft(feats[0, where], ids[0, where], shared, position=position)
    b = drafter.draft(feats[0, where], ids[0, where], copied, position=position)
    assert a.cache.shared() and a.cache.keys[0].shape[0] == 1  # the new entries are stored once too
    for x, y in zip(a[:3], b[:3]):
        assert (x is None and y is None) or same(x, y), name
    token = ids[1, where]
    a2 = drafter.draft(a.hidden[:, -1], token, a.cache, position=position, offset=1, inherited=True)
    b2 = drafter.draft(b.hidden[:, -1], token, b.cache, position=position, offset=1, inherited=True)
    assert same(a2.logits, b2.logits), name
    assert not torch.allclose(a2.logits[0], a2.logits[1], atol=1e-3)  # rows 0 and 1 saw different entries


@pytest.mark.parametrize("name", ["specblock", "eagle3"])
def test_decoding_attention_equals_training_attention(name):
    """Without gradients the attention reads each key head for its query group (enable_gqa) instead of
    repeated copies: the output is bitwise the one the training path computes."""
    drafter, _, feats, ids = make(name)
    past = drafter.extend(feats[:, :4], ids[:, :4]).cache
    with torch.no_grad():
        a = drafter.extend(feats[:, 4:], ids[:, 4:], past, position=4).logits
    b = drafter.extend(feats[:, 4:], ids[:, 4:], past, position=4).logits
    assert b.requires_grad and torch.equal(a, b.detach())


def test_small_query_attention_is_the_attention():
    """bf16 decoding steps of a few queries take two products and a float32 softmax (common.py): the
    attention's values within bf16 rounding of float32's fused kernel, query head h reading key head
    h // groups, masked keys ignored, for a mask per row or one shared."""
    from specblock.train.modeling.common import small_query_attention

    torch.manual_seed(0)
    B, Hkv, groups, L, N, hd = 2, 2, 3, 5, 40, 16
    q = torch.randn(B, Hkv * groups, L, hd)
    k, v = torch.randn(B, Hkv, N, hd), torch.randn(B, Hkv, N, hd)
    for mask in (torch.rand(B, 1, L, N) > 0.4, torch.rand(1, 1, L, N) > 0.4):
        mask[..., 0], mask[..., 1] = True, False  # key 1: seen by no query
        ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        out = small_query_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask, groups)
        assert out.dtype == torch.bfloat16 and out.shape == ref.shape
        torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)
        changed = v.clone()
        changed[:, :, 1] += 100.0
        assert torch.equal(
            small_query_attention(q.bfloat16(), k.bfloat16(), changed.bfloat16(), mask, groups), out
        )


@pytest.mark.parametrize("name", ["specblock", "eagle3"])
def test_bf16_decoding_steps_follow_the_float32_ones(name, monkeypatch):
    """A bf16 drafter's decoding call (the small-query path) gives the float32 call's logits within bf16
    rounding."""
    from specblock.train.modeling import common

    calls, small = [], common.small_query_attention
    monkeypatch.setattr(common, "small_query_attention", lambda *a: calls.append(1) or small(*a))
    drafter, _, feats, ids = make(name)
    past = drafter.extend(feats[:, :4], ids[:, :4]).cache
    with torch.no_grad():
        ref = drafter.extend(feats[:, 4:6], ids[:, 4:6], past, position=4).logits
        assert calls == []  # float32: the fused kernel
        half = drafter.to(torch.bfloat16)
        past16 = DraftCache(
            [x.bfloat16() for x in past.keys], [x.bfloat16() for x in past.values], past.visible
        )
        out = half.extend(feats[:, 4:6].bfloat16(), ids[:, 4:6], past16, position=4).logits
    assert out.dtype == torch.bfloat16 and calls  # bf16: the small-query path ran
    torch.testing.assert_close(out.float(), ref, atol=0.15, rtol=0.05)


# ---------------------------------------------------------------- EAGLE-3 TTT


def test_eagle3_ttt_causality():
    drafter, _, feats, ids = make("eagle3", "h48", ttt_length=4)
    base = drafter(feats, ids).logits
    t = 2
    later = feats.clone()
    later[:, t + 1] += 1.0  # features of a later position: nothing at <= t changes, at any step
    out = drafter(later, ids).logits
    assert same(out[:, : t + 1], base[:, : t + 1]) and not same(out[:, t + 1, 0], base[:, t + 1, 0])
    changed = ids.clone()
    changed[:, t + 2] = (ids[:, t + 2] + 1) % 90  # step s at t reads tokens t..t+s: steps 0, 1 unchanged
    out = drafter(feats, changed).logits
    assert same(out[:, t, :2], base[:, t, :2]) and not same(out[:, t, 2], base[:, t, 2])
    assert same(out[:, :t, :2], base[:, :t, :2])
    earlier = feats.clone()
    earlier[:, t - 1] += 1.0
    assert all(not same(drafter(earlier, ids).logits[:, t, s], base[:, t, s]) for s in range(4))


def test_eagle3_draft_matches_the_training_forward():
    drafter, _, feats, ids = make("eagle3", ttt_length=3)
    out = drafter(feats, ids, torch.ones(B, T))
    context = None
    for t in range(T):
        logits, hidden, _, context = drafter.draft(feats[:, t], ids[:, t], context, position=t)
        assert same(logits[:, 0], out.logits[:, t, 0])  # one step per call: K' = 1
        past = context
        for s in range(1, 3):  # TTT steps: own earlier steps at position t on top of the context
            token = shift_left(ids, s)[:, t]
            logits, hidden, _, past = drafter.draft(
                hidden[:, 0], token, past, position=t, offset=s, inherited=True
            )
            assert same(logits[:, 0], out.logits[:, t, s]) and same(hidden[:, 0], out.hidden[:, t, s])
