"""The drafters as pure modules: shapes, gradients, registry, draft vocabulary, SpecBlock's masks by
perturbation and its layer shift (the inference paths: test_drafting_paths.py)."""

import pytest
import torch
from transformers import Qwen3Config

from specblock.train.drafters import TRAIN_SPECS, build_drafter
from specblock.train.modeling import (
    SpecBlockConfig,
    build_vocab_map,
    count_tokens,
    start_from_target_layers,
)
from specblock.train.modeling.specblock import layer_shift, rank_features
from specblock.train.modeling.vocab import target_to_draft_ids

from tiny_drafters import SHAPES, B, T, make, make_target, perturbed_fusion, same

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


# ---------------------------------------------------------------- decoder layers from the target's


def test_specblock_layers_start_as_the_targets_top_layers():
    drafter, target, feats, ids = make("specblock", "h48", num_layers=2)  # the target has 6 layers
    before = {k: v.clone() for k, v in drafter.state_dict().items()}
    assert start_from_target_layers(drafter, target.model.layers) == [4, 5]
    for mine, theirs in zip(drafter.layers, target.model.layers[4:]):
        theirs = theirs.state_dict()
        for k, v in mine.state_dict().items():
            assert torch.equal(v, theirs[k]), k
    for k, v in drafter.state_dict().items():  # nothing outside the decoder layers moved
        if not k.startswith("layers."):
            assert torch.equal(v, before[k]), k
    # the copies are the drafter's own parameters: training them leaves the target as it was
    drafter.layers[0].mlp.up_proj.weight.data.add_(1.0)
    assert not torch.equal(drafter.layers[0].mlp.up_proj.weight, target.model.layers[4].mlp.up_proj.weight)
    assert drafter(feats, ids).logits.isfinite().all()


def test_eagle3_layer_takes_the_target_layer_on_its_hidden_half():
    drafter, target, _, _ = make("eagle3", "h48")
    H = target.config.hidden_size
    before = {k: v.clone() for k, v in drafter.midlayer.state_dict().items()}
    assert start_from_target_layers(drafter, target.model.layers) == [5]
    top, mid = target.model.layers[5].state_dict(), drafter.midlayer.state_dict()
    for proj in ("q_proj", "k_proj", "v_proj"):  # input [embedding ; hidden]: the target's on the hidden half
        key = f"self_attn.{proj}.weight"
        assert torch.equal(mid[key][:, H:], top[key])
        assert torch.equal(mid[key][:, :H], before[key][:, :H])
    for key in ("self_attn.o_proj.weight", "mlp.down_proj.weight", "post_attention_layernorm.weight"):
        assert torch.equal(mid[key], top[key])
    assert torch.equal(mid["hidden_norm.weight"], top["input_layernorm.weight"])
    assert torch.equal(mid["input_layernorm.weight"], before["input_layernorm.weight"])  # reads embeddings


def test_target_layers_that_do_not_fit_are_refused_by_name():
    drafter, _, _, _ = make("specblock", "h32", num_layers=3)
    small = make_target(*SHAPES["h32"])  # 2 layers
    with pytest.raises(ValueError, match="3 decoder layers, the target 2"):
        start_from_target_layers(drafter, small.model.layers)
    drafter, _, _, _ = make("specblock", "h32", num_layers=1)
    other = make_target(*SHAPES["h48"])  # another width
    with pytest.raises(
        ValueError, match=r"self_attn.q_proj.weight \(\(48, 48\) in the target, \(32, 32\) here\)"
    ):
        start_from_target_layers(drafter, other.model.layers)
    with pytest.raises(ValueError, match="names no decoder_layers"):
        start_from_target_layers(torch.nn.Linear(2, 2), small.model.layers)
