import pytest
import torch

from specblock.train.batching import collate, shifted_tokens, teacher_and_valid
from specblock.train.losses import LossConfig
from specblock.train.teacher_law import TeacherLaw


def test_collate_right_pads():
    rows = [
        {"input_ids": torch.tensor([5, 6, 7]), "loss_mask": torch.tensor([0, 1, 1])},
        {"input_ids": torch.tensor([8]), "loss_mask": torch.tensor([1])},
    ]
    b = collate(rows, pad_id=0)
    assert b["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert b["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]] and b["loss_mask"].tolist() == [
        [0, 1, 1],
        [1, 0, 0],
    ]
    assert shifted_tokens(b["input_ids"]).tolist() == [[6, 7], [0, 0]]


def test_teacher_rows_and_validity_follow_the_eagle3_alignment():
    T, V, K = 6, 5, 2
    logits = torch.zeros(1, T, V)
    for t in range(T):
        logits[0, t, t % V] = 10.0  # the target's argmax at position t is token t % V
    batch = {
        "attention_mask": torch.ones(1, T, dtype=torch.long),
        "loss_mask": torch.tensor([[0, 0, 1, 1, 1, 1]]),
    }
    d2t = torch.tensor([0, 1, 2, 3])  # token 4 is outside the draft vocabulary
    t2d = torch.tensor([True, True, True, True, False])
    law, valid = teacher_and_valid(batch, logits, d2t, t2d, K)
    assert law.probs.shape == (1, T + K, 4)  # one row per target position, plus K rows of padding
    teacher = law.slot_grid(1, T - 1, K)
    assert teacher.probs.shape == (1, T - 1, K, 4)
    assert teacher.probs.untyped_storage().data_ptr() == law.probs.untyped_storage().data_ptr()  # a view
    # slot k at position t is taught by the target at t+1+k
    assert int(teacher.argmax[0, 0, 0]) == 1 and int(teacher.argmax[0, 0, 1]) == 2
    assert int(teacher.probs[0, 3, 1].argmax()) == 5 % V and teacher.probs[0, 3, 1].sum() > 0.99
    assert (teacher.probs[0, T - 2, 1] == 0).all()  # t+1+k = T: past the end, zero padding
    # predicted token t+2+k must exist, be an assistant token, and the target token must be drafted
    expected = torch.zeros(T - 1, K, dtype=torch.bool)
    for t in range(T - 1):
        for k in range(K):
            p = t + 2 + k
            expected[t, k] = p <= T - 1 and batch["loss_mask"][0, p] == 1 and (t + 1 + k) % V != 4
    assert torch.equal(valid[0], expected)


def test_bf16_logits_give_the_teacher_of_their_float32_upcast_bit_for_bit():
    """The strategies hand the target's logits over in its own dtype (bf16 for our targets): the teacher's
    law, argmax and validity equal those of the logits upcast first, ties included (bf16 has many)."""
    g = torch.Generator().manual_seed(0)
    B, T, V, K = 2, 9, 64, 3
    logits = (torch.randint(0, 6, (B, T, V), generator=g) / 4).to(torch.bfloat16)  # ties at the top
    batch = {
        "attention_mask": torch.ones(B, T, dtype=torch.long),
        "loss_mask": torch.randint(0, 2, (B, T), generator=g),
    }
    d2t = torch.randperm(V, generator=g)[:24].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[d2t] = True
    law, valid = teacher_and_valid(batch, logits, d2t, t2d, K)
    law32, valid32 = teacher_and_valid(batch, logits.float(), d2t, t2d, K)
    assert (
        law.probs.dtype == torch.float32 and torch.equal(valid, valid32) and valid.any() and not valid.all()
    )
    for mine, theirs in zip(law, law32):
        assert torch.equal(mine, theirs)


def test_target_head_keeps_its_dtype_only_when_asked_and_uncapped():
    from specblock.data.target import TargetHead

    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(32, 8, generator=g).bfloat16(), torch.randn(3, 8, generator=g)
    plain = TargetHead(w)
    assert plain(x).dtype == torch.float32 and plain(x, upcast=False).dtype == torch.bfloat16
    assert torch.equal(plain(x, upcast=False).float(), plain(x))
    capped = TargetHead(w, softcap=5.0)  # the cap is applied in float32 either way
    assert capped(x, upcast=False).dtype == torch.float32 and torch.equal(capped(x, upcast=False), capped(x))


def test_the_caches_argmax_with_the_draft_columns_gives_the_same_teacher():
    """An offline batch with the cache's full-vocabulary argmax hands over the draft columns alone: the same
    law and validity as the full logits."""
    g = torch.Generator().manual_seed(3)
    B, T, V, K = 2, 8, 40, 2
    logits = torch.randn(B, T, V, generator=g, dtype=torch.float64)
    batch = {
        "attention_mask": torch.ones(B, T, dtype=torch.long),
        "loss_mask": torch.ones(B, T, dtype=torch.long),
    }
    d2t = torch.arange(0, V, 3)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[d2t] = True
    full = teacher_and_valid(batch, logits, d2t, t2d, K)
    cut = teacher_and_valid(batch, logits[:, :, d2t], d2t, t2d, K, target_argmax=logits.argmax(-1))
    assert torch.equal(full[1], cut[1]) and full[1].any() and not full[1].all()
    for a, b in zip(full[0], cut[0]):
        assert torch.equal(a, b)


def test_a_teacher_temperature_sharpens_the_law_and_keeps_its_argmax():
    """teacher_and_valid(..., temperature=t) is the law of logits / t: the same argmax and validity, a
    sharper law for t < 1 (more mass on the argmax, lower entropy)."""
    g = torch.Generator().manual_seed(3)
    B, T, V, K = 2, 7, 6, 2
    logits = torch.randn(B, T, V, generator=g) * 2
    batch = {
        "attention_mask": torch.ones(B, T, dtype=torch.long),
        "loss_mask": torch.ones(B, T, dtype=torch.long),
    }
    d2t, t2d = torch.arange(V), torch.ones(V, dtype=torch.bool)
    plain, valid = teacher_and_valid(batch, logits, d2t, t2d, K)
    sharp, valid_sharp = teacher_and_valid(batch, logits, d2t, t2d, K, temperature=0.5)
    scaled, _ = teacher_and_valid(batch, logits / 0.5, d2t, t2d, K)
    torch.testing.assert_close(sharp.probs, scaled.probs)
    torch.testing.assert_close(sharp.neg_entropy, scaled.neg_entropy)
    assert torch.equal(sharp.argmax, plain.argmax) and torch.equal(valid_sharp, valid)
    rows = slice(0, T)  # the padding rows after them are zeros in both
    top = plain.argmax[:, rows, None]
    assert (sharp.probs[:, rows].gather(-1, top) > plain.probs[:, rows].gather(-1, top)).all()
    assert (sharp.neg_entropy[:, rows] > plain.neg_entropy[:, rows]).all()


def test_a_teacher_temperature_must_be_positive():
    for bad in (0.0, -1.0):
        with pytest.raises(ValueError, match="temperature"):
            TeacherLaw.from_logits(torch.zeros(2, 3), temperature=bad)
        with pytest.raises(ValueError, match="teacher_temperature"):
            LossConfig(teacher_temperature=bad)
