"""Serving-time adaptation: the served-data loss, the feedback buffer, the bandit on synthetic gain/cost
streams, the revert guard, and exactness of decoding while the drafter adapts."""

from __future__ import annotations

import pytest
import torch

from specblock.evaluate.adapt import (
    Adapter,
    AdaptConfig,
    CostAwareBandit,
    Feedback,
    LowRankHead,
    Window,
    arm_parameters,
    feedback_loss,
    slot_labels,
)
from specblock.evaluate.decoding.loop import DecodeConfig, SpeculativeDecoder
from specblock.evaluate.decoding.trees import TreeConfig
from specblock.evaluate.verify.exact import enumerate_outcomes

import tiny_decoding as td  # tests/support


def test_feedback_loss_counts_the_valid_prefix_only():
    # T=1 position, K=3 slots, Vd=4: slot 0 right, slot 1 wrong, slot 2 never counted
    logits = torch.tensor([[[5.0, 0, 0, 0], [0, 5.0, 0, 0], [0, 0, 5.0, 0]]])
    targets = torch.tensor([[0, 2, 2]])
    valid = torch.ones(1, 3, dtype=torch.bool)
    loss, m = feedback_loss(logits, None, targets, valid, (1, 4, 10))
    ce = torch.nn.functional.cross_entropy(logits[0, :2], targets[0, :2], reduction="none")
    assert m["supervised"] == 2 and torch.isclose(loss, ce.mean())
    # rank labels: the target token ranks 1 at slot 0 (class 0) and 2 at slot 1 (class 1)
    rank_logits = torch.zeros(1, 3, 4)
    loss2, _ = feedback_loss(logits, rank_logits, targets, valid, (1, 4, 10))
    assert torch.isclose(loss2 - loss, torch.log(torch.tensor(4.0)))
    # a target outside the draft vocabulary (-1) and a position past the end are not supervised
    _, m = feedback_loss(logits, None, torch.tensor([[-1, 1, 2]]), valid, (1, 4, 10))
    assert m["supervised"] == 0


def test_slot_labels_align_with_training():
    targets, valid = slot_labels(torch.tensor([10, 11, 12, 13]), 2)
    assert targets[0].tolist() == [11, 12] and targets[2, 0] == 13
    assert valid.tolist() == [[True, True], [True, True], [True, False], [False, False]]


def test_feedback_ring_is_bounded_and_split_by_request():
    fb = Feedback(capacity=5)
    fb.new_request()
    fb.add(torch.zeros(3, 4), torch.tensor([1, 2, 3]), torch.eye(8)[:3])
    fb.new_request()
    fb.add(torch.ones(4, 4), torch.tensor([4, 5, 6, 7]), torch.eye(8)[4:])
    assert len(fb) == 5  # the oldest two positions fell out
    segs = fb.segments()
    assert [s[1].tolist() for s in segs] == [[4, 5, 6, 7]]  # a 1-position remnant is not a segment
    assert segs[0][2].tolist() == [4, 5, 6, 7] and segs[0][0].dtype == torch.float16


# ---------------------------------------------------------------- the bandit on synthetic streams


def window(beta: float, tokens: int = 200, call_s: float = 0.05) -> Window:
    return Window(tokens, round(tokens / beta), call_s * round(tokens / beta))


def test_bandit_explores_then_exploits_the_arm_worth_its_cost():
    cfg = AdaptConfig(arms=["rank_head", "last_layer"], ucb_c=0.1)
    b = CostAwareBandit(["rank_head", "last_layer"], cfg)
    w = window(1.5)
    first = b.choose(w)
    b.observe(first, 0.3 if first == "rank_head" else 0.0, 0.2)
    second = b.choose(w)  # the other arm is still unexplored, hence optimistic
    assert {first, second} == {"rank_head", "last_layer"}
    b.observe(second, 0.3 if second == "rank_head" else 0.0, 0.2)
    picks = []
    for _ in range(20):
        arm = b.choose(w)
        picks.append(arm)
        if arm != "none":
            b.observe(arm, 0.3 if arm == "rank_head" else 0.0, 0.2)
    assert picks.count("rank_head") >= 18


def test_bandit_does_not_update_when_the_cost_exceeds_the_gain():
    cfg = AdaptConfig(arms=["lora"], ucb_c=0.0)
    b = CostAwareBandit(["lora"], cfg)
    w = window(2.0, tokens=100, call_s=0.01)  # a short window: little time left to win back
    b.observe("lora", 0.2, 5.0)  # a small lift for 5 s of training
    assert b.expected_net("lora", w) < 0 and b.choose(w) == "none"
    # the same lift on a long window (many tokens left to serve) pays for the update
    assert b.choose(window(2.0, tokens=100_000, call_s=0.01)) == "lora"


def test_bandit_prices_the_gain_with_the_throughput_model():
    cfg = AdaptConfig(arms=["lora"], ucb_c=0.0)
    b = CostAwareBandit(["lora"], cfg)
    b.observe("lora", 0.5, 1.0)
    w = Window(tokens=300, target_calls=200, seconds=10.0)  # beta 1.5, 0.05 s per call
    saved = 300 * 0.05 * (1 / 1.5 - 1 / 2.0)
    assert b.expected_net("lora", w) == pytest.approx(saved - 1.0)


# ---------------------------------------------------------------- the adapter on a real (tiny) drafter


@pytest.fixture()
def setup():
    target = td.tiny_target(64, 1.0)
    return target, td.drafters(target)


def test_lora_head_starts_as_the_base_head(setup):
    _, ds = setup
    d = ds["specblock"]
    x = torch.randn(3, d.hidden_size)
    before = d.lm_head(x)
    arm_parameters(d, "lora", 4)
    assert isinstance(d.lm_head, LowRankHead) and torch.allclose(d.lm_head(x), before)


def test_revert_guard_restores_the_weights(setup, monkeypatch):
    _, ds = setup
    d = ds["specblock"]
    ad = Adapter(d, AdaptConfig(arms=["last_layer"], window=1, cost_prior=0.0))
    original = {k: v.clone() for k, v in d.state_dict().items()}

    def bad_update(arm, segments):
        with torch.no_grad():
            d.norm.weight.mul_(-1.0)  # an update that ruins the drafter ...
        return 0.0

    replays = iter([0.5, 0.7])  # ... yet looks better on the held-out replay
    monkeypatch.setattr(ad, "update", bad_update)
    monkeypatch.setattr(ad, "replay_acceptance", lambda segs: next(replays))
    first = ad.observe_request(tokens=30, target_calls=10, seconds=1.0)  # beta 3: update (optimistic)
    assert first.arm == "last_layer" and not first.rejected
    assert first.replay_lift == pytest.approx(0.2) and ad.bandit.stats["last_layer"].pulls == 1
    assert not torch.equal(d.norm.weight, original["norm.weight"])
    monkeypatch.setattr(ad.bandit, "choose", lambda w: "none")
    second = ad.observe_request(tokens=30, target_calls=20, seconds=1.0)  # beta fell to 1.5: revert
    assert second.reverted
    assert all(torch.equal(v, original[k]) for k, v in d.state_dict().items() if k in original)
    ad.reset()
    assert not ad.events and ad.bandit.stats["last_layer"].pulls == 0


def test_an_update_that_does_not_help_on_held_out_feedback_is_undone(setup, monkeypatch):
    _, ds = setup
    d = ds["specblock"]
    ad = Adapter(d, AdaptConfig(arms=["lora"], window=1))
    replays = iter([0.5, 0.4])
    monkeypatch.setattr(ad, "replay_acceptance", lambda segs: next(replays))
    ev = ad.observe_request(tokens=30, target_calls=10, seconds=1.0)
    assert ev.arm == "lora" and ev.rejected and ev.replay_lift == pytest.approx(-0.1)
    assert not isinstance(d.lm_head, LowRankHead)  # the adapter head is gone with the undo
    assert ad.bandit.stats["lora"].lift == pytest.approx(-0.1)


def test_replay_acceptance_counts_leading_right_slots(setup):
    _, ds = setup
    d = ds["eagle3"]
    ad = Adapter(d, AdaptConfig(arms=["lora"]))
    feats, toks = torch.randn(6, d.feature_size), torch.randint(0, 64, (6,))
    with torch.no_grad():
        guess = d(feats[None], toks[None]).logits[0].argmax(-1)  # [T,K] draft ids (full vocab: = target ids)
    labels = torch.full((6,), 63)
    labels[1:4] = guess[0, :3]  # position 0: slots 0, 1, 2 right -> 3 accepted (K = 3)
    assert ad.replay_acceptance([(feats, toks, labels)]) >= 3 / 3  # positions 0..2 have all K labels


@pytest.mark.parametrize("drafter", ["specblock", "eagle3"])
def test_greedy_decoding_stays_exact_while_adapting(setup, drafter):
    target, ds = setup
    d = ds[drafter]
    before = {k: v.clone() for k, v in d.state_dict().items()}
    arms = ["rank_head", "last_layer", "lora"] if drafter == "specblock" else ["last_layer", "lora"]
    ad = Adapter(d, AdaptConfig(arms=arms, window=1, steps=2, lr=1e-2))
    cfg = DecodeConfig("tree", max_new_tokens=16, tree=TreeConfig(budget=10, steps=2, beam=3, topk=3))
    dec = SpeculativeDecoder(target, d, cfg, adapter=ad)
    ar = SpeculativeDecoder(target, None, DecodeConfig(mode="autoregressive", max_new_tokens=16))
    for prompt in ([1, 5, 9, 3], [7, 2], [4, 4, 8], [9, 1, 1, 2]):
        assert dec.generate(prompt).tokens == ar.generate(prompt).tokens
    assert len(ad.events) == 4 and {e.arm for e in ad.events} >= set(arms)  # every arm explored
    assert all(e.replay_lift is not None for e in ad.events if e.arm != "none")
    del before


def test_sampled_decoding_law_is_exact_after_adaptation(monkeypatch):
    """After updates changed the drafter, the law of generated sequences is still exactly the target's
    (exact enumeration of the real loop, chain + block verification, temperature 1, top-p 0.5)."""
    target = td.tiny_target(td.VOCAB, 12.0, seed=2)
    d = td.drafters(target, seed=3)["specblock"]
    ad = Adapter(d, AdaptConfig(arms=["lora"], window=1, steps=2, lr=5e-2))
    counter = iter(range(100))
    monkeypatch.setattr(ad, "replay_acceptance", lambda segs: next(counter))  # keep every update
    greedy = SpeculativeDecoder(
        target, d, DecodeConfig("chain", "block", 1, 2, max_new_tokens=12), adapter=ad
    )
    for prompt in ([1, 5, 9, 3], [2, 6]):
        greedy.generate(prompt)
    assert isinstance(d.lm_head, LowRankHead) and d.lm_head.B.abs().sum() > 0
    cfg = DecodeConfig("chain", "block", 1, 2, 1.0, 0.5, max_new_tokens=2)
    dec = SpeculativeDecoder(target, d, cfg)
    law: dict[tuple, float] = {}
    for w, seq in enumerate_outcomes(lambda s: tuple(dec.generate(td.PROMPT, sampler=s).tokens)):
        law[seq] = law.get(seq, 0.0) + w
    ref = td.exact_law(target, 1.0, 0.5, horizon=2)
    assert max(abs(law.get(x, 0.0) - ref.get(x, 0.0)) for x in set(law) | set(ref)) < 1e-6


def test_adapt_config_errors():
    with pytest.raises(ValueError, match="arms"):
        AdaptConfig(arms=["everything"])
    with pytest.raises(ValueError, match="positive"):
        AdaptConfig(window=0)
