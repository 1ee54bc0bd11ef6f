"""One function for the target's outputs: the teacher a strategy distills from is the same whether the
target runs inside the step (online) or its features were cached by the data stage (offline), also
for a target whose head soft-caps its logits (Gemma 2's final_logit_softcapping)."""

import torch

from specblock.data.target import FeatureTarget, TargetHead
from specblock.train.distill import StrategyConfig
from specblock.train.drafters import build_drafter, train_spec
from specblock.train.losses import LossConfig
from specblock.train.modeling import Eagle3Config

from tiny_models import TINY_SOFTCAP, tiny_softcapped

VOCAB, LAYERS = 40, [2, 3, 4]


def strategies(target):
    """The EAGLE-3 strategy twice over one drafter: online (the target as teacher) and offline."""
    d2t = torch.arange(0, VOCAB, 2)
    cfg = Eagle3Config(ttt_length=2, draft_vocab_size=len(d2t), num_feature_layers=len(LAYERS))
    embed, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    module = build_drafter("eagle3", cfg, target.config, embed, head, d2t)
    make = train_spec("eagle3").strategy
    online = make(module, target, LAYERS, LossConfig(), StrategyConfig())
    offline = make(module, None, LAYERS, LossConfig(), StrategyConfig(), TargetHead.of(target, copy=True))
    return online, offline


def test_softcapped_target_gives_the_same_teacher_online_and_offline():
    target = tiny_softcapped(VOCAB)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    cached = FeatureTarget(target, LAYERS)(
        ids, batch["attention_mask"], with_logits=False
    )  # what capture stores
    online, offline = strategies(target)

    features, logits = online.target_outputs(batch)
    features_off, logits_off = offline.target_outputs(
        {**batch, "features": cached.features, "last_hidden": cached.last_hidden}
    )
    torch.testing.assert_close(features_off, features, rtol=0, atol=0)
    torch.testing.assert_close(logits_off, logits, rtol=1e-6, atol=1e-6)
    # the cap is in force: the raw head's logits exceed it, and differ from the teacher's
    raw = cached.last_hidden @ target.get_output_embeddings().weight.T
    assert raw.abs().max() > TINY_SOFTCAP >= logits.abs().max()
    assert not torch.allclose(raw, logits, atol=1e-3)
    # and the loss both strategies train on is the same
    out, out_off = (
        online.forward_loss(batch, 0, 0),
        offline.forward_loss({**batch, "features": cached.features, "last_hidden": cached.last_hidden}, 0, 0),
    )
    torch.testing.assert_close(offline.loss(out_off.sums, out_off.counts), online.loss(out.sums, out.counts))


def test_an_offline_batch_with_the_caches_argmax_trains_on_the_same_loss():
    """With `target_argmax` (data/target_argmax.py) the strategy computes the draft vocabulary's columns
    alone: the same loss as through the full head."""
    target = tiny_softcapped(VOCAB)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    cached = FeatureTarget(target, LAYERS)(ids, batch["attention_mask"], with_logits=False)
    _, offline = strategies(target)
    plain = {**batch, "features": cached.features, "last_hidden": cached.last_hidden}
    top = offline.head(cached.last_hidden).argmax(-1)
    features, logits, got = offline.teacher_inputs({**plain, "target_argmax": top})
    assert logits.shape[-1] == len(offline.d2t) and torch.equal(got, top)
    torch.testing.assert_close(
        logits, offline.head(cached.last_hidden)[..., offline.d2t], rtol=1e-6, atol=1e-6
    )
    a, b = offline.forward_loss(plain, 0, 0), offline.forward_loss({**plain, "target_argmax": top}, 0, 0)
    torch.testing.assert_close(offline.loss(b.sums, b.counts), offline.loss(a.sums, a.counts))
    assert all(torch.equal(a.counts[k], b.counts[k]) for k in a.counts)  # the same valid entries


def test_the_loss_configs_teacher_temperature_reaches_the_teacher():
    """With loss.teacher_temperature = 0.5 a strategy trains on exactly the loss it computes at 1 for teacher
    logits twice as large: the knob scales the teacher's logits and nothing else."""
    target = tiny_softcapped(VOCAB)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(2))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    cached = FeatureTarget(target, LAYERS)(ids, batch["attention_mask"], with_logits=False)
    batch = {**batch, "features": cached.features, "last_hidden": cached.last_hidden}
    _, strategy = strategies(target)
    features, logits = strategy.target_outputs(batch)

    def loss(temperature: float, scale: float) -> torch.Tensor:
        strategy.loss_cfg = LossConfig(teacher_temperature=temperature)
        strategy.teacher_inputs = lambda b: (features, logits * scale, None)
        out = strategy.forward_loss(batch, 0, 0)
        return strategy.loss(out.sums, out.counts)

    torch.testing.assert_close(loss(0.5, 1.0), loss(1.0, 2.0))
    assert not torch.allclose(loss(0.5, 1.0), loss(1.0, 1.0))
