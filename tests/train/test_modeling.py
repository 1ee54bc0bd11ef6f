"""The drafters as pure modules: shapes, gradients, masks by perturbation, cross-block inheritance,
EAGLE-3 TTT causality, draft vocabulary, inference paths equal to the training forward, registry."""

import pytest
import torch
from transformers import Qwen3Config

from specblock.train.drafters import TRAIN_SPECS, build_drafter
from specblock.train.modeling import (
    DraftCache,
    Eagle3Config,
    SpecBlockConfig,
    build_vocab_map,
    count_tokens,
    shift_left,
)
from specblock.train.modeling.specblock import block_offsets, layer_shift, rank_features
from specblock.train.modeling.vocab import target_to_draft_ids

from tiny_models import tiny_llama

# Two target shapes: (hidden, heads, kv heads, layers, vocab).
SHAPES = {"h32": (32, 4, 2, 2, 100), "h48": (48, 6, 2, 6, 90)}
B, T = 2, 6
ATOL = 1e-5


def make_target(hidden, heads, kv, layers, vocab, seed=0):
    return tiny_llama(
        vocab, seed=seed, hidden=hidden, layers=layers, heads=heads, kv_heads=kv, tie_word_embeddings=False
    )


def make(name, shape="h32", d2t=None, seed=0, **cfg_kwargs):
    """(drafter in eval mode, target model, features [B,T,3H], aligned ids [B,T])."""
    target = make_target(*SHAPES[shape], seed=seed)
    cfg = SpecBlockConfig(**cfg_kwargs) if name == "specblock" else Eagle3Config(**cfg_kwargs)
    drafter = build_drafter(
        name,
        cfg,
        target.config,
        target.get_input_embeddings().weight,
        target.get_output_embeddings().weight,
        d2t,
    ).eval()
    H, V = target.config.hidden_size, target.config.vocab_size
    return drafter, target, torch.randn(B, T, 3 * H), torch.randint(0, V, (B, T))


def perturbed_fusion(drafter, where, calls=(0,)):
    """Forward hook adding noise to the fused slot inputs x[:, t, k] for (t, k) in `where`, on the
    listed calls of the fusion module only (call 0 = block 1)."""
    count = [0]

    def hook(module, args, out):
        i, count[0] = count[0], count[0] + 1
        if i not in calls:
            return out
        out = out.clone()
        for t, k in where:
            out[:, t, k] += torch.randn_like(out[:, t, k])
        return out

    return drafter.fusion.register_forward_hook(hook)


def same(a, b):
    return torch.allclose(a, b, atol=ATOL, rtol=0)


# ---------------------------------------------------------------- shapes, gradients, registry


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("name", ["specblock", "eagle3"])
def test_output_shapes(name, shape):
    K = 4 if name == "specblock" else 3
    kwargs = {"block_size": K} if name == "specblock" else {"ttt_length": K}
    drafter, target, feats, ids = make(name, shape, **kwargs)
    H, V = target.config.hidden_size, target.config.vocab_size
    out = drafter(feats, ids, torch.ones(B, T))
    assert drafter.block_size == K
    assert out.logits.shape == (B, T, K, V) and out.hidden.shape == (B, T, K, H)
    if name == "specblock":
        assert out.rank_logits.shape == (B, T, K, 4)
    else:
        assert out.rank_logits is None


@pytest.mark.parametrize("name", ["specblock", "eagle3"])
def test_embedding_frozen_and_every_trainable_parameter_gets_a_gradient(name):
    drafter, _, feats, ids = make(name, "h48", **({"num_layers": 3} if name == "specblock" else {}))
    out = drafter(feats, ids)
    loss = out.logits.square().mean() + (0 if out.rank_logits is None else out.rank_logits.square().mean())
    loss.backward()
    assert not drafter.embed_tokens.weight.requires_grad and drafter.embed_tokens.weight.grad is None
    for pname, p in drafter.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and p.grad.abs().sum() > 0, pname


def test_rank_head_input_is_detached():
    drafter, _, feats, ids = make("specblock")
    drafter(feats, ids).rank_logits.square().sum().backward()
    for pname, p in drafter.named_parameters():
        if pname.startswith("rank_head."):
            assert p.grad is not None and p.grad.abs().sum() > 0, pname
        else:
            assert p.grad is None, pname


def test_rank_features_on_hand_made_logits():
    flat = rank_features(torch.zeros(30), topk=10)  # 30 equal logits: top-20 softmax is uniform
    assert flat.shape == (15,)
    assert torch.allclose(flat[:10], torch.full((10,), -torch.log(torch.tensor(20.0))))
    assert torch.allclose(flat[10:13], torch.zeros(3))  # gaps top1-top2/3/5
    assert torch.allclose(flat[13:], torch.tensor([1 / 20, torch.log(torch.tensor(20.0))]))
    top5 = torch.tensor([50.0, 40.0, 30.0, 20.0, 10.0])
    peaked = rank_features(torch.cat([top5, torch.zeros(20)]), topk=10)
    assert torch.allclose(peaked[10:13], torch.tensor([10.0, 20.0, 40.0])) and peaked[13] > 0.99


def test_registry_builds_both_by_name():
    target = make_target(*SHAPES["h32"])
    args = (target.config, target.get_input_embeddings().weight, target.get_output_embeddings().weight)
    assert {"specblock", "eagle3"} <= set(TRAIN_SPECS)
    assert type(build_drafter("specblock", None, *args)).__name__ == "SpecBlockDrafter"
    assert type(build_drafter("eagle3", None, *args)).__name__ == "Eagle3Drafter"
    with pytest.raises(KeyError):
        build_drafter("medusa", None, *args)
    with pytest.raises(TypeError):
        build_drafter("eagle3", SpecBlockConfig(), *args)
    with pytest.raises(ValueError):
        SpecBlockConfig(rank_buckets=[4, 1])


def test_qwen3_style_target_with_explicit_head_dim():
    cfg = Qwen3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    emb = torch.randn(64, 32)
    for name in ("specblock", "eagle3"):
        drafter = build_drafter(name, None, cfg, emb, emb)
        assert drafter(torch.randn(1, 5, 96), torch.randint(0, 64, (1, 5))).logits.shape[-1] == 64


@pytest.mark.parametrize("name", ["specblock", "eagle3"])
def test_runs_under_bf16_autocast(name):
    drafter, _, feats, ids = make(name)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = drafter(feats, ids, torch.ones(B, T))
    assert torch.isfinite(out.logits.float()).all()


# ---------------------------------------------------------------- draft vocabulary


def test_vocab_map_picks_most_frequent_ties_by_id():
    counts = torch.tensor([5, 9, 0, 9, 1, 5, 7])
    d2t, t2d = build_vocab_map(counts, 4)
    assert d2t.tolist() == [0, 1, 3, 6]  # 9 (ids 1, 3), 7 (id 6), then 5 with the lower id 0; ascending
    assert t2d.tolist() == [True, True, False, True, False, False, True]
    full, all_in = build_vocab_map(counts, None)
    assert full.tolist() == list(range(7)) and all_in.all()
    assert target_to_draft_ids(torch.tensor([3, 2, 6]), d2t).tolist() == [2, -1, 3]
    ids, mask = torch.tensor([[1, 1, 6, 3]]), torch.tensor([[1, 1, 0, 1]])
    assert count_tokens(ids, 7, mask).tolist() == [0, 2, 0, 1, 0, 0, 0]


@pytest.mark.parametrize("name", ["specblock", "eagle3"])
def test_full_and_pruned_vocabulary(name):
    d2t, _ = build_vocab_map(torch.randint(0, 1000, (100,)), 40)
    drafter, target, feats, ids = make(name, d2t=d2t, draft_vocab_size=40)
    assert drafter(feats, ids).logits.shape[-1] == 40
    assert torch.equal(drafter.lm_head.weight, target.get_output_embeddings().weight[d2t])
    assert torch.equal(drafter.t2d.nonzero().squeeze(1), d2t)
    full, target, _, _ = make(name)
    assert torch.equal(full.lm_head.weight, target.get_output_embeddings().weight)
    assert torch.equal(full.d2t, torch.arange(100))
    with pytest.raises(ValueError):
        make(name, draft_vocab_size=40)  # a pruned size needs a map


# ---------------------------------------------------------------- SpecBlock masks and shift


def test_specblock_mask_by_perturbation():
    drafter, _, feats, ids = make("specblock", "h48")
    base = drafter(feats, ids).logits
    t, s = 3, 1
    with perturbed_fusion(drafter, [(t, s + 1)]):  # a later slot of the same position
        out = drafter(feats, ids).logits
    assert same(out[:, :t], base[:, :t]) and same(out[:, t, : s + 1], base[:, t, : s + 1])
    assert not same(out[:, t, s + 1], base[:, t, s + 1]) and not same(out[:, t + 1, 0], base[:, t + 1, 0])
    later = feats.clone()
    later[:, t + 1] += 1.0  # a later position's condition
    out = drafter(later, ids).logits
    assert same(out[:, : t + 1], base[:, : t + 1]) and not same(out[:, t + 1], base[:, t + 1])
    later_ids = ids.clone()
    later_ids[:, t + 1] = (ids[:, t + 1] + 1) % 100  # a later position's token
    assert same(drafter(feats, later_ids).logits[:, : t + 1], base[:, : t + 1])
    earlier = feats.clone()
    earlier[:, t - 1] += 1.0  # an earlier position changes every slot of position t
    out = drafter(earlier, ids).logits
    assert all(not same(out[:, t, k], base[:, t, k]) for k in range(4))
    with perturbed_fusion(drafter, [(0, 3)]):  # ... including its last slot
        assert not same(drafter(feats, ids).logits[:, 1, 0], base[:, 1, 0])


def test_specblock_padding_hides_keys():
    drafter, _, feats, ids = make("specblock")
    mask = torch.ones(B, T)
    mask[:, 2] = 0
    changed = feats.clone()
    changed[:, 2] += 1.0
    assert same(drafter(changed, ids, mask).logits[:, 3:], drafter(feats, ids, mask).logits[:, 3:])
    assert not same(drafter(changed, ids).logits[:, 3:], drafter(feats, ids).logits[:, 3:])


def test_layer_shift_function():
    h = torch.randn(2, 3, 4, 8)
    proj = torch.nn.Linear(16, 8, bias=False)
    out = layer_shift(h, proj)
    assert torch.allclose(out[:, :, 0], proj(torch.cat([h[:, :, 0], h[:, :, 0]], -1)))
    assert torch.allclose(out[:, :, 2], proj(torch.cat([h[:, :, 2], h[:, :, 1]], -1)))


def test_layer_shift_feeds_the_previous_slot():
    """With every attention output zeroed, slots only talk through the shift: perturbing slot 1 reaches
    slot 2 (one shift = one hop, so not slot 3) iff the h_{k-1} half of W is not zero."""
    drafter, _, feats, ids = make("specblock", num_layers=2)
    H = drafter.hidden_size
    with torch.no_grad():
        for layer in drafter.layers:
            layer.self_attn.o_proj.weight.zero_()
        drafter.shift_proj[0].weight[:, H:].normal_(std=0.3)
    base = drafter(feats, ids).logits
    with perturbed_fusion(drafter, [(2, 1)]):
        out = drafter(feats, ids).logits
    assert not same(out[:, 2, 2], base[:, 2, 2]) and same(out[:, 2, 3], base[:, 2, 3])
    assert same(out[:, 2, 0], base[:, 2, 0])
    with torch.no_grad():
        drafter.shift_proj[0].weight[:, H:].zero_()  # ablate: slot 2 no longer sees slot 1
    base = drafter(feats, ids).logits
    with perturbed_fusion(drafter, [(2, 1)]):
        assert same(drafter(feats, ids).logits[:, 2, 2], base[:, 2, 2])


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
