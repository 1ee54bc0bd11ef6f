"""Losses and metrics of specblock.train.losses on hand-made logits (small V, K = 3 or 4)."""

import math

import pytest
import torch
import torch.nn.functional as F

from specblock.train.losses import (
    CurriculumConfig,
    LossConfig,
    FULL,
    RANK,
    distill_terms,
    normalised_loss,
    prefix_weight,
    rank_terms,
    slot_weights,
    specblock_loss,
    valid_prefix_mask,
)
from specblock.train.rank_labels import rank_of_target
from specblock.train.teacher_law import forward_kl

V = 5
LN2 = math.log(2.0)


def masked_mean_per_slot(x, mask):
    """Reference: x [B,S,K], mask [B,S,K] bool -> [K] per-slot mean over masked entries (0 if none)."""
    return (x * mask).sum((0, 1)) / mask.sum((0, 1)).clamp_min(1)


def peaked(tokens, sharpness: float = 4.0, noise: float = 0.0) -> torch.Tensor:
    """Token ids [...] -> logits [..., V] with argmax at the token (noise < sharpness/2 keeps it)."""
    logits = F.one_hot(torch.as_tensor(tokens), V).float() * sharpness
    return logits + noise * torch.rand(logits.shape, generator=torch.Generator().manual_seed(0))


# The constructed case shared by the prefix-mask, metrics and gradient tests: one sequence, K = 4,
# teacher argmax 1 everywhere; draft tokens say which slots are top-1 correct.
TEACHER_TOK = torch.ones(1, 5, 4, dtype=torch.long)
DRAFT_TOK = torch.tensor(
    [
        [
            [1, 1, 1, 1],  # all correct                          -> accepts 4
            [1, 0, 1, 1],  # slot 1 wrong: slot 1 kept, 2-3 masked -> accepts 1
            [0, 1, 1, 1],  # slot 0 wrong: only slot 0 kept        -> accepts 0
            [1, 1, 1, 1],  # slot 0 invalid                        -> not a verify step
            [1, 1, 1, 1],  # slot 1 invalid: breaks the chain      -> accepts 1
        ]
    ]
)
VALID = torch.tensor(
    [
        [
            [True, True, True, True],
            [True, True, True, True],
            [True, True, True, True],
            [False, True, True, True],
            [True, False, True, True],
        ]
    ]
)
PREFIX = torch.tensor(
    [
        [
            [True, True, True, True],
            [True, True, False, False],
            [True, False, False, False],
            [False, False, False, False],
            [True, False, False, False],
        ]
    ]
)


def case(noise: float = 0.5):
    draft = peaked(DRAFT_TOK, 4.0, noise).requires_grad_()
    return draft, peaked(TEACHER_TOK, 3.0), VALID.clone()


# ---------------------------------------------------------------- distillation


def test_slot_weights():
    torch.testing.assert_close(slot_weights(3), torch.tensor([1.0, 0.8, 0.64]))
    torch.testing.assert_close(slot_weights(4, 0.5), torch.tensor([1.0, 0.5, 0.25, 0.125]))


def test_forward_kl_exact_value_and_shift_invariance():
    teacher = torch.tensor([0.5, 0.25, 0.25]).log().view(1, 1, 1, 3)
    draft = torch.tensor([0.25, 0.5, 0.25]).log().view(1, 1, 1, 3)
    valid = torch.ones(1, 1, 1, dtype=torch.bool)
    # KL = .5 ln(.5/.25) + .25 ln(.25/.5) + 0 = ln2 / 4
    expected = torch.tensor([[[LN2 / 4]]])
    torch.testing.assert_close(forward_kl(draft, teacher, valid), expected)
    torch.testing.assert_close(forward_kl(draft + 7.0, teacher - 3.0, valid), expected)


def test_forward_kl_zero_when_draft_equals_teacher():
    logits = torch.randn(2, 3, 4, 7, generator=torch.Generator().manual_seed(1))
    draft = logits.clone().requires_grad_()
    kl = forward_kl(draft, logits, torch.ones(2, 3, 4, dtype=torch.bool))
    torch.testing.assert_close(kl, torch.zeros(2, 3, 4), atol=1e-6, rtol=0)
    kl.sum().backward()
    torch.testing.assert_close(draft.grad, torch.zeros_like(draft), atol=1e-6, rtol=0)


def test_forward_kl_invalid_rows_are_zero_even_with_inf_padding():
    teacher = torch.zeros(1, 1, 2, V)
    teacher[0, 0, 1] = float("-inf")  # a padded row
    draft = torch.randn(1, 1, 2, V).requires_grad_()
    kl = forward_kl(draft, teacher, torch.tensor([[[True, False]]]))
    assert kl[0, 0, 1] == 0 and kl[0, 0, 0] > 0
    kl.sum().backward()
    assert torch.isfinite(draft.grad).all()
    assert (draft.grad[0, 0, 1] == 0).all() and (draft.grad[0, 0, 0] != 0).any()


def test_forward_kl_topk_uses_unrenormalised_teacher_mass():
    teacher = torch.tensor([0.5, 0.25, 0.125, 0.125]).log().view(1, 1, 1, 4)
    draft = torch.zeros(1, 1, 1, 4)  # uniform: q = .25
    valid = torch.ones(1, 1, 1, dtype=torch.bool)
    # top-2: .5 ln(.5/.25) + .25 ln(.25/.25) = ln2 / 2
    torch.testing.assert_close(forward_kl(draft, teacher, valid, topk=2), torch.tensor([[[LN2 / 2]]]))
    torch.testing.assert_close(forward_kl(draft, teacher, valid, topk=4), forward_kl(draft, teacher, valid))


def test_distill_terms_are_per_slot_ratios_of_sums_with_slot_weights():
    kl = torch.tensor([[[1.0, 2.0, 3.0, 9.0], [3.0, 4.0, 5.0, 9.0]]])  # [B=1, S=2, K=4]
    valid = torch.tensor([[[True, True, True, False], [True, True, False, False]]])
    terms = distill_terms(kl, valid, valid, decay=0.8, alpha=0.0)
    assert terms.counts[FULL].tolist() == [2.0, 2.0, 1.0, 0.0]
    torch.testing.assert_close(terms.sums[FULL], torch.tensor([4.0, 0.8 * 6.0, 0.64 * 3.0, 0.0]))
    loss = normalised_loss(terms.sums, terms.counts, rank_budget=10)
    torch.testing.assert_close(loss, torch.tensor(2.0 + 0.8 * 3.0 + 0.64 * 3.0))  # slot 3: no entry -> 0


def test_distill_terms_blend_full_and_prefix_means():
    kl = torch.tensor([[[1.0, 2.0, 3.0], [3.0, 4.0, 5.0]]])  # [B=1, S=2, K=3]
    valid = torch.ones(1, 2, 3, dtype=torch.bool)
    prefix = torch.tensor([[[True, True, False], [True, False, False]]])  # slot 2: no prefix entry
    full, prefix_only = torch.tensor([2.0, 3.0, 4.0]), torch.tensor([2.0, 2.0, 0.0])
    torch.testing.assert_close(masked_mean_per_slot(kl, prefix), prefix_only)
    for alpha in (0.0, 0.25, 1.0):
        terms = distill_terms(kl, valid, prefix, 0.8, alpha)
        expected = (slot_weights(3) * ((1 - alpha) * full + alpha * prefix_only)).sum()
        torch.testing.assert_close(normalised_loss(terms.sums, terms.counts, 10), expected)


def test_normalised_loss_of_added_terms_is_the_loss_of_the_joined_batch():
    """The accumulation contract: terms of two halves, normalised by the summed counts, add up to the
    loss of the whole batch, although the halves' own means differ (prefix and rank class counts too)."""
    g = torch.Generator().manual_seed(0)
    kl = torch.rand(4, 3, 3, generator=g)
    valid = torch.rand(4, 3, 3, generator=g) > 0.3
    prefix = valid & (torch.rand(4, 3, 3, generator=g) > 0.5)
    rank_logits = torch.randn(4, 3, 3, 4, generator=g)
    classes = torch.randint(0, 4, (4, 3, 3), generator=g)

    def terms(rows):
        t = distill_terms(kl[rows], valid[rows], prefix[rows], 0.8, 0.3)
        t.sums[RANK], t.counts[RANK], _ = rank_terms(rank_logits[rows], classes[rows], valid[rows])
        return t

    whole, halves = terms(slice(0, 4)), [terms(slice(0, 1)), terms(slice(1, 4))]
    counts = {k: halves[0].counts[k] + halves[1].counts[k] for k in whole.counts}
    joined = sum(normalised_loss(h.sums, counts, rank_budget=1) for h in halves)
    torch.testing.assert_close(joined, normalised_loss(whole.sums, whole.counts, rank_budget=1))
    own = sum(normalised_loss(h.sums, h.counts, rank_budget=1) for h in halves) / 2
    assert not torch.isclose(own, joined)  # a mean of the halves' losses differs


def test_valid_prefix_mask_constructed_case():
    draft, teacher, valid = case()
    assert torch.equal(valid_prefix_mask(draft, teacher, valid), PREFIX)


# ---------------------------------------------------------------- curriculum


@pytest.mark.parametrize("shape", ["linear", "cosine", "step"])
def test_prefix_weight_endpoints_and_monotone(shape):
    cfg = CurriculumConfig(start=10, end=110, shape=shape)
    alphas = [prefix_weight(cfg, step, 0) for step in range(0, 130)]
    assert alphas[0] == 0.0 and alphas[10] == 0.0 and alphas[110] == 1.0 and alphas[-1] == 1.0
    assert all(a <= b for a, b in zip(alphas, alphas[1:]))
    assert all(0.0 <= a <= 1.0 for a in alphas)


def test_prefix_weight_shapes_and_units():
    assert prefix_weight(CurriculumConfig(0, 100), 25, 0) == pytest.approx(0.25)
    assert prefix_weight(CurriculumConfig(0, 100, shape="cosine"), 50, 0) == pytest.approx(0.5)
    assert prefix_weight(CurriculumConfig(0, 100, shape="cosine"), 25, 0) < 0.25
    assert prefix_weight(CurriculumConfig(0, 100, shape="step"), 99, 0) == 0.0
    epochs = CurriculumConfig(0, 4, unit="epochs")
    assert prefix_weight(epochs, 10_000, 1) == pytest.approx(0.25)  # the step is ignored
    assert prefix_weight(epochs, 0, 2.5) == pytest.approx(0.625)
    assert prefix_weight(CurriculumConfig(0, 0), 0, 0) == 1.0  # the authors' recipe
    assert prefix_weight(CurriculumConfig(), 0, 0) == 0.0  # default starts from the full loss


@pytest.mark.parametrize(
    "kwargs", [{"unit": "tokens"}, {"shape": "exp"}, {"start": 5, "end": 4}, {"start": -1}]
)
def test_curriculum_config_validation(kwargs):
    with pytest.raises(ValueError):
        CurriculumConfig(**kwargs)


def test_specblock_loss_follows_the_curriculum():
    draft, teacher, valid = case()
    kl = forward_kl(draft, teacher, valid).detach()
    full, prefix = masked_mean_per_slot(kl, valid), masked_mean_per_slot(kl, PREFIX)
    cfg = LossConfig()  # linear 0 -> 1000 steps
    for step, alpha in [(0, 0.0), (250, 0.25), (1000, 1.0), (5000, 1.0)]:
        out = specblock_loss(draft, teacher, valid, None, cfg, step=step)
        assert out.prefix_alpha == pytest.approx(alpha)
        torch.testing.assert_close(out.slot_losses, (1 - alpha) * full + alpha * prefix)
        torch.testing.assert_close(out.loss, (slot_weights(4) * out.slot_losses).sum())


def test_prefix_mask_zeroes_gradients_of_masked_slots():
    draft, teacher, valid = case()
    out = specblock_loss(draft, teacher, valid, None, LossConfig(curriculum=CurriculumConfig(0, 0)), step=0)
    assert set(out.terms.sums) == {FULL, "prefix"} and out.terms.counts["prefix"].tolist() == [4, 2, 1, 1]
    out.loss.backward()
    has_grad = draft.grad.abs().sum(-1) > 0  # [1,S,K]
    assert torch.equal(has_grad, PREFIX)
    draft.grad = None
    out = specblock_loss(draft, teacher, valid, None, LossConfig(curriculum=CurriculumConfig(10, 20)), step=0)
    out.loss.backward()
    assert torch.equal(draft.grad.abs().sum(-1) > 0, valid)  # alpha = 0: every valid slot learns


# ---------------------------------------------------------------- rank labels (the rest: test_rank_loss.py)


def test_rank_of_target_counts_strictly_higher_logits():
    draft = torch.tensor([3.0, 3.0, 1.0, 0.0, 2.0]).expand(1, 1, 4, V)
    teacher = peaked(torch.tensor([[[1, 4, 3, 0]]]))
    # token 1 ties token 0 at the top -> 1; token 4 (2.0) is below two 3.0s -> 3; token 3 is last -> 5
    assert rank_of_target(draft, teacher).tolist() == [[[1, 3, 5, 1]]]
    assert rank_of_target(torch.zeros(1, 1, 1, V), teacher[..., :1, :]).item() == 1  # all tied


# ---------------------------------------------------------------- combined loss and metrics


def test_metrics_sums_and_counts_on_constructed_case():
    draft, teacher, valid = case()
    m = specblock_loss(draft, teacher, valid, None, LossConfig(), step=0).metrics
    assert m["top1_sum"].tolist() == [3.0, 3.0, 5.0, 5.0]
    assert m["top1_count"].tolist() == [4.0, 4.0, 5.0, 5.0]
    assert m["prefix_sum"].tolist() == [4.0, 2.0, 1.0, 1.0]
    assert m["accept_len_sum"].item() == 6.0 and m["accept_len_count"].item() == 4.0
    assert m["accept_hist_sum"].tolist() == [1.0, 2.0, 0.0, 0.0, 1.0]
    assert m["accept_hist_count"].item() == 4.0
    assert not any(k.startswith("rank") for k in m)
    assert all(not t.requires_grad for t in m.values())


def test_specblock_loss_with_rank_head_and_gate():
    draft, teacher, valid = case()
    rank_logits = torch.randn(1, 5, 4, 4, generator=torch.Generator().manual_seed(2)).requires_grad_()
    # curriculum start = end = 0: the same distillation loss at every step
    cfg = LossConfig(curriculum=CurriculumConfig(0, 0), rank_start_step=100, rank_weight=0.5)
    base = specblock_loss(draft, teacher, valid, None, cfg, step=0)
    before = specblock_loss(draft, teacher, valid, rank_logits, cfg, step=99)
    assert before.loss.item() == pytest.approx(base.loss.item()) and before.rank_loss > 0
    before.loss.backward()
    assert rank_logits.grad is not None and (rank_logits.grad == 0).all()
    after = specblock_loss(draft, teacher, valid, rank_logits, cfg, step=100)
    assert after.loss.item() == pytest.approx(base.loss.item() + 0.5 * after.rank_loss.item())
    assert {"rank_acc_sum", "rank_acc_count", "rank_class_acc_sum"} <= set(after.metrics)
    rank_logits.grad = None
    after.loss.backward()
    assert rank_logits.grad.abs().sum() > 0


def test_specblock_loss_bf16_inputs():
    draft, teacher, valid = case()
    ref = specblock_loss(
        draft.detach().bfloat16().float(), teacher.bfloat16().float(), valid, None, LossConfig(), step=500
    )
    draft16 = draft.detach().bfloat16().requires_grad_()
    rank16 = torch.zeros(1, 5, 4, 4, dtype=torch.bfloat16, requires_grad=True)
    out = specblock_loss(draft16, teacher.bfloat16(), valid, rank16, LossConfig(), step=500)
    assert out.loss.dtype == torch.float32 and out.prefix_alpha == pytest.approx(0.5)
    assert out.loss.item() == pytest.approx(ref.loss.item() + out.rank_loss.item(), rel=1e-5)
    out.loss.backward()
    assert draft16.grad.dtype == torch.bfloat16 and torch.isfinite(draft16.grad.float()).all()


def test_specblock_loss_checks_shapes_and_config():
    draft, teacher, valid = case()
    with pytest.raises(ValueError, match="rank logits"):
        specblock_loss(draft, teacher, valid, torch.zeros(1, 5, 4, 3), LossConfig(), step=0)
    with pytest.raises(ValueError, match="valid"):
        specblock_loss(draft, teacher, valid.float(), None, LossConfig(), step=0)
    with pytest.raises(ValueError):
        LossConfig(draft_topk=0)


def test_rank_confusion_and_branch_coverage():
    from specblock.train.rank_labels import branch_coverage, rank_confusion

    classes = torch.tensor([0, 0, 1, 3, 2, 3])
    pred = torch.tensor([0, 1, 1, 0, 2, 3])
    valid = torch.tensor([True, True, True, True, True, False])
    m = rank_confusion(pred, classes, valid, 4)
    assert m.sum() == 5 and m[0, 0] == 1 and m[0, 1] == 1 and m[1, 1] == 1 and m[3, 0] == 1 and m[3, 3] == 0
    ranks = torch.tensor([1, 1, 3, 20, 7, 50])
    share, width = branch_coverage(ranks, pred, valid, (2, 4, 10, 0))
    # widths 2, 4, 4, 2, 10: ranks 1, 1, 3, 7 are covered, 20 is not
    assert share == pytest.approx(4 / 5) and width == pytest.approx(22 / 5)
