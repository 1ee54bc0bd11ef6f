"""The fast training step computes the same loss and gradients as the plain computation it replaced.

The reference below is the step as first written: the teacher copied K times into [B,S,K,V] by
indexing, KL through a float32/64 log-softmax, and dense slot masks in every attention call (no causal
shortcut). The strategy under test builds the teacher once per position (`TeacherLaw.slot_grid` views),
takes the KL's gradient in closed form (`_KLToSoftmax`) and lets the first block run plain causal
attention. Everything runs in float64 so "the same" means equal to ~1e-12, with right padding, two
SpecBlock blocks (multi-block TTT) and the EAGLE-3 unroll.
"""

import pytest
import torch
import torch.nn.functional as F

from specblock.train import losses
from specblock.train.batching import shifted_tokens
from specblock.train.losses import leading_run
from specblock.train.rank_labels import rank_classes
from specblock.train.teacher_law import TeacherLaw, forward_kl
from specblock.train.modeling import common

from tiny_models import distill_strategy

V, H, T, B, K, VD = 48, 32, 12, 3, 3, 20


def reference_kl(draft_logits, teacher_logits, valid):
    """The original forward KL: sum p (log p - log_softmax(z)), p masked to 0 where invalid."""
    log_q = F.log_softmax(draft_logits, dim=-1)
    p = F.softmax(teacher_logits, dim=-1).masked_fill(~valid.unsqueeze(-1), 0.0)
    return torch.xlogy(p, p).sum(-1) - (p * log_q).sum(-1)


def reference_teacher(batch, logits, d2t, t2d, slots):
    """The original K-fold copy: teacher[:, t, k] = logits[:, t+1+k, d2t], -inf past the end."""
    steps = logits.shape[1] - 1
    rows = torch.arange(steps)[:, None] + 1 + torch.arange(slots)
    in_range = rows <= steps
    rows = rows.clamp(max=steps)
    teacher = logits[:, :, d2t][:, rows].masked_fill(~in_range[None, :, :, None], float("-inf"))
    predicted = (rows + 1).clamp(max=steps)
    exists = in_range & (rows + 1 <= steps)
    real = (batch["attention_mask"].bool() & batch["loss_mask"].bool())[:, predicted]
    return teacher, exists[None] & real & t2d[logits.argmax(-1)][:, rows]


def mean_per_slot(x, mask):
    return (x * mask).sum((0, 1)) / mask.sum((0, 1)).clamp_min(1)


def reference_block_loss(out, teacher, valid, cfg, step, rank_buckets):
    """specblock_loss as first written, on a materialised teacher (no TeacherLaw)."""
    correct = valid & (out.logits.argmax(-1) == teacher.argmax(-1))
    prefix = valid & leading_run(correct)
    alpha = losses.prefix_weight(cfg.curriculum, step, 0.0)
    kl = reference_kl(out.logits, teacher, valid)
    per_slot = (1 - alpha) * mean_per_slot(kl, valid) + alpha * mean_per_slot(kl, prefix)
    loss = (losses.slot_weights(kl.shape[-1], cfg.slot_decay) * per_slot).sum()
    if out.rank_logits is not None:
        ranks = 1 + (out.logits > out.logits.gather(-1, teacher.argmax(-1, keepdim=True))).sum(-1)
        classes = rank_classes(ranks, rank_buckets)
        loss = loss + cfg.rank_weight * losses.rank_loss(out.rank_logits, classes, valid, cfg.rank_budget)[0]
    return loss


def reference_forward_loss(strategy, batch, step):
    features, logits = strategy.target_outputs(batch)
    tokens, attention = shifted_tokens(batch["input_ids"]), batch["attention_mask"][:, 1:]
    outputs, offsets = strategy.draft(features[:, :-1], tokens, attention, step)
    teacher, valid = reference_teacher(batch, logits, strategy.d2t, strategy.t2d, K + max(offsets))
    total = 0.0
    for out, off in zip(outputs, offsets):
        total = total + reference_block_loss(
            out, teacher[:, :, off : off + K], valid[:, :, off : off + K], strategy.loss_cfg, step,
            strategy.rank_buckets,
        )  # fmt: skip
    return total


def padded_batch():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, V, (B, T), generator=g)
    lengths = torch.tensor([T, T - 3, T - 5])
    attention = (torch.arange(T)[None] < lengths[:, None]).long()
    loss_mask = attention.clone()
    loss_mask[:, :3] = 0
    return {"input_ids": ids * attention, "attention_mask": attention, "loss_mask": loss_mask}


@pytest.mark.parametrize("name", ["specblock", "eagle3"])
def test_fast_step_has_the_same_loss_and_gradients(name, monkeypatch):
    strategy, batch, step = distill_strategy(name), padded_batch(), 5  # step 5: alpha = 0.5, 2 blocks
    params = [p for p in strategy.module.parameters() if p.requires_grad]

    out = strategy.forward_loss(batch, step, 0)
    fast = strategy.loss(out.sums, out.counts)
    fast_grads = torch.autograd.grad(fast, params)
    # the reference: dense masks everywhere (grid_mask never answers "causal")
    monkeypatch.setattr(common, "right_padded", lambda valid: False)
    ref = reference_forward_loss(strategy, batch, step)
    ref_grads = torch.autograd.grad(ref, params)

    assert fast.item() > 0
    torch.testing.assert_close(fast, ref, rtol=1e-12, atol=1e-12)
    for p, a, b in zip(params, fast_grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
    assert sum(g.abs().sum() for g in fast_grads) > 0


def test_kl_gradient_is_softmax_minus_teacher_and_zero_where_invalid():
    torch.manual_seed(0)
    z = torch.randn(2, 3, 2, 7, dtype=torch.float64, requires_grad=True)
    teacher = torch.randn(2, 3, 2, 7, dtype=torch.float64)
    valid = torch.rand(2, 3, 2) > 0.3
    weights = torch.randn(2, 3, 2, dtype=torch.float64)
    fast = forward_kl(z, teacher, valid)
    torch.testing.assert_close(fast, reference_kl(z, teacher, valid))
    (grad,) = torch.autograd.grad((fast * weights).sum(), z)
    expected = (z.softmax(-1) - teacher.softmax(-1)) * (weights * valid).unsqueeze(-1)
    torch.testing.assert_close(grad, expected.detach())
    assert torch.autograd.gradcheck(lambda x: forward_kl(x, teacher, valid), (z.detach().requires_grad_(),))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_kl_backward_works_in_place_on_its_own_buffer_only(dtype):
    """The backward pass computes softmax(z) - p in one buffer in place: the logits it saved (whatever their
    dtype, float32 ones being their own upcast) and the teacher are left as they were, and the gradient is
    the one of the out-of-place formula."""
    torch.manual_seed(1)
    z = torch.randn(2, 4, 3, 9).to(dtype).requires_grad_()
    p = torch.randn(2, 6, 9).softmax(-1).unfold(1, 3, 1).movedim(-1, 2)  # [2, 4, 3, 9], a strided view
    law = TeacherLaw(p, torch.xlogy(p, p).sum(-1), p.argmax(-1))
    valid = torch.rand(2, 4, 3) > 0.3
    z_before, p_before = z.detach().clone(), p.clone()
    (grad,) = torch.autograd.grad(forward_kl(z, law, valid).sum(), z)
    assert torch.equal(z.detach(), z_before) and torch.equal(p, p_before)
    z32 = z_before.double()
    expected = (z32.softmax(-1) - p.double()) * valid.unsqueeze(-1)
    tol = {torch.float64: 1e-12, torch.float32: 1e-6, torch.bfloat16: 1e-2}[dtype]
    assert grad.dtype == dtype
    torch.testing.assert_close(grad.double(), expected, rtol=tol, atol=tol)


def test_grid_mask_is_causal_only_for_right_padding():
    right = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    assert common.grid_mask(4, 2, right, 2, torch.device("cpu")) is None
    holes = torch.tensor([[1, 0, 1, 1]])
    mask = common.grid_mask(4, 2, holes, 1, torch.device("cpu"))
    assert mask is not None and not mask[0, 0, 4, 2]  # position 2 may not see padding position 1
    # the causal claim itself: with every key valid the slot mask IS the flat causal mask
    full = common.slot_mask(5, 3, None, earlier=True, same_slots=None)[0, 0]
    assert torch.equal(full, torch.ones(15, 15, dtype=torch.bool).tril())


@pytest.mark.parametrize("shape", [(5, 7), (2, 5, 7), (2, 5, 3, 7)])
@pytest.mark.parametrize("chunk", [1, 20, 10**9])  # one row per chunk, a few rows, all at once
def test_kl_in_chunks_is_the_kl(shape, chunk, monkeypatch):
    """The KL and its gradient, computed chunk by chunk along the rows, equal the formula on any layout."""
    from specblock.train import teacher_law

    monkeypatch.setattr(teacher_law, "KL_CHUNK_ELEMENTS", chunk)
    torch.manual_seed(2)
    z = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
    teacher = torch.randn(*shape, dtype=torch.float64)
    valid = torch.rand(*shape[:-1]) > 0.3
    weights = torch.randn(*shape[:-1], dtype=torch.float64)
    fast = forward_kl(z, teacher, valid)
    torch.testing.assert_close(fast, reference_kl(z, teacher, valid), rtol=1e-12, atol=1e-12)
    (grad,) = torch.autograd.grad((fast * weights).sum(), z)
    expected = (z.softmax(-1) - teacher.softmax(-1)) * (weights * valid).unsqueeze(-1)
    torch.testing.assert_close(grad, expected.detach(), rtol=1e-12, atol=1e-12)


def reference_law(logits):
    """TeacherLaw.from_logits as first written: the whole tensor at once."""
    z = logits.detach().float() if logits.element_size() < 4 else logits.detach()
    p = F.softmax(z, dim=-1).nan_to_num(0.0)
    return p, torch.xlogy(p, p).sum(-1), z.max(-1).indices


@pytest.mark.parametrize("shape", [(7,), (5, 7), (2, 5, 7), (2, 5, 3, 7)])
@pytest.mark.parametrize("chunk", [1, 20, 10**9])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_teacher_law_in_chunks_is_the_law(shape, chunk, dtype, monkeypatch):
    """The law built chunk by chunk (and its padding rows) equals the whole-tensor computation, -inf rows
    (padding) included; bf16 logits are upcast to float32 as before."""
    from specblock.train import teacher_law

    monkeypatch.setattr(teacher_law, "KL_CHUNK_ELEMENTS", chunk)
    torch.manual_seed(3)
    logits = torch.randn(*shape, dtype=torch.float64).to(dtype)
    logits[(0,) * (len(shape) - 1)] = float("-inf")  # a padding row: p = 0 there
    logits[..., 2] = logits[..., 4]  # ties: the first maximal index, as before
    pad = 0 if len(shape) == 1 else 2
    law = TeacherLaw.from_logits(logits, pad=pad)
    ref = reference_law(logits)
    dim = 0 if len(shape) <= 2 else 1
    n = shape[dim] if len(shape) > 1 else None
    for got, want in zip(law, ref):
        assert got.dtype == want.dtype
        if n is not None:
            assert got.shape[dim] == n + pad
            assert not got.narrow(dim, n, pad).any()  # zero rows: p = 0, neg_entropy 0, argmax 0
            got = got.narrow(dim, 0, n)
        assert torch.equal(got, want)


@pytest.mark.parametrize("chunk", [1, 20, 10**9])
def test_rank_of_token_in_chunks_counts_higher_logits(chunk, monkeypatch):
    from specblock.train import teacher_law
    from specblock.train.rank_labels import rank_of_token

    monkeypatch.setattr(teacher_law, "KL_CHUNK_ELEMENTS", chunk)
    torch.manual_seed(4)
    logits = torch.randint(0, 5, (2, 6, 3, 9)).bfloat16()  # many ties
    token = torch.randint(0, 9, (2, 6, 3))
    expected = 1 + (logits > logits.gather(-1, token[..., None])).sum(-1)
    assert torch.equal(rank_of_token(logits, token), expected)
    assert torch.equal(rank_of_token(logits[0, 0, 0], token[0, 0, 0]), expected[0, 0, 0])
