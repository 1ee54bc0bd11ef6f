"""The Rank Head's supervision: rank labels and classes, branching per class, and the rank loss's parts
(ordinal soft targets, distance and budget weights, class re-weighting, the rank chain, the gate)."""

import math

import pytest
import torch

from specblock.train.losses import (
    budget_weights,
    distance_weight,
    ordinal_soft_targets,
    rank_chain_mask,
    rank_loss,
    rank_loss_weight,
)
from specblock.train.rank_labels import (
    RELEASE_TOPK_PER_CLASS,
    branching_for_class,
    rank_classes,
)


# ---------------------------------------------------------------- rank labels


def test_rank_classes_default_and_custom_buckets():
    ranks = torch.arange(1, 13)
    assert rank_classes(ranks).tolist() == [0, 1, 1, 1, 2, 2, 2, 2, 2, 2, 3, 3]
    assert rank_classes(torch.tensor([1, 2, 3, 9]), (1, 2)).tolist() == [0, 1, 2, 2]
    for bad in [(), (0, 4), (4, 4), (4, 1)]:
        with pytest.raises(ValueError):
            rank_classes(ranks, bad)


def test_branching_for_class():
    classes = torch.tensor([[0, 1], [2, 3]])
    assert branching_for_class(classes).tolist() == [[2, 4], [10, 0]]
    assert branching_for_class(classes, RELEASE_TOPK_PER_CLASS).tolist() == [[2, 4], [6, 4]]


# ---------------------------------------------------------------- rank loss parts


def test_ordinal_soft_targets_rows_sum_to_one_and_are_asymmetric():
    soft = ordinal_soft_targets(torch.arange(4), 4)  # [4, C=4], row t
    torch.testing.assert_close(soft.sum(-1), torch.ones(4))
    raw = torch.tensor([1 / 25, 1 / 9, 1.0, 1 / 4])  # t = 2: c=0: 1/(1+2+2)^2, c=1: 1/3^2, c=3: 1/2^2
    torch.testing.assert_close(soft[2], raw / raw.sum())
    assert (soft.argmax(-1) == torch.arange(4)).all()
    assert soft[1, 0] < soft[1, 2]  # under-estimating is smoothed less than over-estimating


def test_distance_weight_is_asymmetric():
    t = torch.tensor([2, 0, 1, 3])
    p = torch.tensor([0, 2, 1, 2])
    assert distance_weight(t, p).tolist() == [5.0, 3.0, 1.0, 3.0]


def test_budget_weights_per_slot_and_class():
    counts = torch.tensor([[20.0, 3.0, 0.0, 0.0], [5.0, 0.0, 0.0, 0.0]])  # [K=2, C=4]
    w = budget_weights(counts, budget=10)
    assert w.tolist() == [[0.5, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]]  # min(1, 10 / count)
    assert (budget_weights(counts, budget=0) == 1).all()


def test_rank_loss_reweights_classes_over_budget():
    zeros = torch.zeros(1, 25, 1, 4)  # uniform rank logits: CE = ln 4 for any soft target, pred = 0
    classes = torch.zeros(1, 25, 1, dtype=torch.long)
    classes[0, 20:, 0] = 2  # 20 entries of class 0 (in the chain: pred 0 is right), 5 of class 2
    valid = torch.ones(1, 25, 1, dtype=torch.bool)
    loss, _ = rank_loss(zeros, classes, valid, budget=10)
    # class 0: weight 10/20, distance weight 1; class 2: weight 1, distance weight 5
    expected = (20 * 0.5 * 1 + 5 * 1.0 * 5) * math.log(4) / (20 * 0.5 + 5 * 1.0)
    assert loss.item() == pytest.approx(expected)


def test_rank_chain_mask_stops_after_first_wrong_prediction():
    classes = torch.tensor([[[0, 1, 2, 0], [0, 1, 2, 0], [0, 1, 2, 0], [0, 1, 2, 0]]])
    pred = torch.tensor([[[0, 1, 2, 0], [0, 0, 2, 0], [3, 1, 2, 0], [0, 1, 2, 0]]])
    valid = torch.ones(1, 4, 4, dtype=torch.bool)
    valid[0, 3, 1] = False
    first_wrong_1, first_wrong_0 = [True, True, False, False], [True, False, False, False]
    expected = [[[True] * 4, first_wrong_1, first_wrong_0, first_wrong_0]]  # last: slot 1 invalid
    assert rank_chain_mask(pred, classes, valid).tolist() == expected


def test_rank_loss_value_and_normalisation():
    zeros = torch.zeros(1, 2, 1, 4)  # uniform rank logits: CE = ln 4 for any soft target, pred = 0
    valid = torch.ones(1, 2, 1, dtype=torch.bool)
    one, _ = rank_loss(zeros[:, :1], torch.tensor([[[2]]]), valid[:, :1])
    assert one.item() == pytest.approx(5 * math.log(4))  # distance weight 1 + 2 + 2
    # two entries (classes 0 and 2), both class weight 1: sum(w_dist * CE) / sum(w_class)
    two, metrics = rank_loss(zeros, torch.tensor([[[0], [2]]]), valid)
    assert two.item() == pytest.approx((1 + 5) * math.log(4) / 2)
    assert metrics["rank_acc_sum"].tolist() == [1.0] and metrics["rank_acc_count"].tolist() == [2.0]
    assert metrics["rank_class_acc_sum"].tolist() == [1.0, 0, 0, 0]
    assert metrics["rank_class_acc_count"].tolist() == [1.0, 0, 1.0, 0]


def test_rank_loss_gradient_only_inside_the_chain():
    rank_logits = torch.zeros(1, 1, 3, 4)
    rank_logits[..., 1] = 1.0  # predicts class 1 at every slot
    rank_logits.requires_grad_()
    classes = torch.tensor([[[1, 0, 1]]])  # slot 1 is the first wrong prediction
    loss, metrics = rank_loss(rank_logits, classes, torch.ones(1, 1, 3, dtype=torch.bool))
    loss.backward()
    assert (rank_logits.grad.abs().sum(-1) > 0).tolist() == [[[True, True, False]]]
    assert metrics["rank_acc_sum"].tolist() == [1.0, 0.0, 1.0]  # accuracy ignores the chain


def test_rank_loss_weight_gate():
    assert rank_loss_weight(1999, 2000) == 0.0
    assert rank_loss_weight(2000, 2000) == 1.0 and rank_loss_weight(0, 0) == 1.0
