"""The teacher's law over the draft vocabulary, as the losses read it, and the forward KL to it.

The target's logits at the positions a block's slots predict, restricted to the draft vocabulary,
become a `TeacherLaw` once per target position (probabilities, sum p log p, argmax); every slot of
every block reads it as a strided view (`slot_grid`), and `forward_kl` computes KL(teacher || draft)
with a closed-form gradient, keeping nothing of size [..., V] but the logits themselves.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor


class TeacherLaw(NamedTuple):
    """The teacher's law as the losses read it, for entries [...]: probs [..., V] float32 (the softmax of
    the teacher's logits over the draft vocabulary), neg_entropy [...] = sum_v p log p, argmax [...] long.
    The trainer builds it once per target position and hands each block a strided view (`slot_grid`):
    slot k at position t reads row t+1+k, so the K slots share rows instead of copying them K times."""

    probs: Tensor
    neg_entropy: Tensor
    argmax: Tensor

    @staticmethod
    def from_logits(logits: Tensor, pad: int = 0, temperature: float = 1.0) -> TeacherLaw:
        """[..., V] teacher logits (rows of -inf, e.g. padding, give p = 0) -> the law per entry, with `pad`
        rows of zeros (p = 0, neg_entropy 0, argmax 0) appended along dim 1 (dim 0 of a 2-D tensor).
        temperature: the law is softmax(logits / temperature); below 1 it sharpens the teacher towards its
        argmax (which it never changes), the token greedy verification accepts.
        Computed chunk by chunk (`row_chunks`: the upcast, softmax, p log p and argmax over a chunk in
        cache, written into the outputs; the same values as over the whole tensor, 1.6x faster on
        [4, 350, 8192] bf16 logits, 2 CPU threads)."""
        if not temperature > 0:
            raise ValueError(f"the teacher's temperature must be > 0, got {temperature}")
        logits = logits.detach()
        if logits.dim() == 1:  # one row
            return TeacherLaw(*(x[0] for x in TeacherLaw.from_logits(logits[None], pad, temperature)))
        dim, chunks = row_chunks(logits)
        rows = list(logits.shape[:-1])
        rows[dim] += pad
        dt = at_least_fp32(logits[..., :0]).dtype
        probs = torch.empty(*rows, logits.shape[-1], dtype=dt, device=logits.device)
        neg_entropy = torch.empty(rows, dtype=dt, device=logits.device)
        argmax = torch.empty(rows, dtype=torch.long, device=logits.device)
        for a, n in chunks:
            z = at_least_fp32(logits.narrow(dim, a, n))
            # the argmax of the logits themselves: dividing rounds, and two near-tied logits could become equal
            argmax.narrow(dim, a, n).copy_(argmax_last(z))
            p = probs.narrow(dim, a, n)
            p.copy_(torch.softmax(z if temperature == 1.0 else z / temperature, dim=-1)).nan_to_num_(0.0)
            neg_entropy.narrow(dim, a, n).copy_(torch.xlogy(p, p).sum(-1))
        total = logits.shape[dim]
        for x in (probs, neg_entropy, argmax):
            x.narrow(dim, total, pad).zero_()
        return TeacherLaw(probs, neg_entropy, argmax)

    def slot_grid(self, start: int, steps: int, K: int) -> TeacherLaw:
        """Per-row law [B, R, ...] -> per-slot [B, steps, K, ...] with entry (t, k) = row start+t+k.
        Views of the same storage (no copy); needs R >= start + steps + K - 1."""

        def grid(x: Tensor) -> Tensor:  # [B,R,*] -> [B,steps,K,*]
            return x[:, start : start + steps + K - 1].unfold(1, K, 1).movedim(-1, 2)

        return TeacherLaw(grid(self.probs), grid(self.neg_entropy), grid(self.argmax))


def argmax_last(x: Tensor) -> Tensor:
    """x [..., V] -> [...] long, the first maximal index: `max(-1).indices`, which on CPU is ~4x faster
    than `argmax(-1)` for bf16 inputs (same result, ties included)."""
    return x.max(dim=-1).indices


def at_least_fp32(x: Tensor) -> Tensor:
    """bf16 / fp16 -> float32; float32 and float64 unchanged (float64 tests stay exact)."""
    return x.float() if x.element_size() < 4 else x


def as_law(teacher: Tensor | TeacherLaw) -> TeacherLaw:
    """Teacher logits [..., V] or an already built law -> TeacherLaw."""
    return teacher if isinstance(teacher, TeacherLaw) else TeacherLaw.from_logits(teacher)


# Rows of the KL per chunk: ~2 MB of float32 logits, so the upcast, log-sum-exp, dot product and the gradient's
# in-place steps run over a chunk in cache instead of over the whole [B, S, K, V] tensor in memory (session 23,
# [4, 378, 4, 8192] bf16 logits, 2 threads: forward 273 -> 82-92 ms, backward 169 -> ~100 ms, same bits). The
# teacher's law (`TeacherLaw.from_logits`) and the Rank Head's labels (`rank_labels.rank_of_token`) use the
# same chunks (session 27).
KL_CHUNK_ELEMENTS = 1 << 19


def row_chunks(x: Tensor) -> tuple[int, list[tuple[int, int]]]:
    """(dim, [(start, length)]): x [..., V] cut along dim 1 (dim 0 for 2-D x) into chunks of about
    KL_CHUNK_ELEMENTS; views of any strided tensor, no copy."""
    dim = 1 if x.dim() >= 3 else 0
    n = x.shape[dim]
    per = max(1, KL_CHUNK_ELEMENTS // max(1, x.numel() // max(1, n)))
    return dim, [(a, min(per, n - a)) for a in range(0, n, per)]


class _KLToSoftmax(torch.autograd.Function):
    """KL(p || softmax(z)) = sum p log p - sum p z + logsumexp(z) per row (p sums to 1), 0 where invalid.
    Backward: dKL/dz = softmax(z) - p. Nothing of size [..., V] is saved but the inputs themselves (z in
    its own dtype, p usually a view shared between slots): a log-softmax would keep a float32 copy. Both
    passes run chunk by chunk (KL_CHUNK_ELEMENTS), the backward in place in one float32 buffer per chunk."""

    @staticmethod
    def forward(ctx, z: Tensor, p: Tensor, neg_entropy: Tensor, valid: Tensor) -> Tensor:
        dt = torch.promote_types(p.dtype, at_least_fp32(z[..., :1]).dtype)
        lse = torch.empty(z.shape[:-1], dtype=dt, device=z.device)
        dot = torch.empty_like(lse)
        dim, chunks = row_chunks(z)
        for a, n in chunks:
            zc = at_least_fp32(z.narrow(dim, a, n)).to(dt)
            lse.narrow(dim, a, n).copy_(torch.logsumexp(zc, dim=-1))
            dot.narrow(dim, a, n).copy_(torch.linalg.vecdot(p.narrow(dim, a, n).to(dt), zc))
        kl = torch.where(valid, neg_entropy - dot + lse, 0.0)
        ctx.save_for_backward(z, p, lse, valid)
        return kl

    @staticmethod
    def backward(ctx, grad: Tensor):
        z, p, lse, valid = ctx.saved_tensors
        g = torch.where(valid, grad, 0.0).unsqueeze(-1)
        dz = torch.empty_like(z)
        dim, chunks = row_chunks(z)
        for a, n in chunks:
            zc = z.narrow(dim, a, n)
            buf = at_least_fp32(zc)
            buf = buf.clone() if buf is zc else buf  # never write into the saved logits
            buf.sub_(lse.narrow(dim, a, n).unsqueeze(-1)).exp_().sub_(p.narrow(dim, a, n))
            dz.narrow(dim, a, n).copy_(buf.mul_(g.narrow(dim, a, n)))
        return dz, None, None, None


def forward_kl(
    draft_logits: Tensor, teacher: Tensor | TeacherLaw, valid: Tensor, topk: int | None = None
) -> Tensor:
    """Per-entry forward KL(teacher || draft) over the draft vocabulary, float32.

    draft_logits [B,S,K,V] (any float dtype); teacher: logits [B,S,K,V] or a TeacherLaw of that shape;
    valid [B,S,K] bool -> kl [B,S,K], 0 and no gradient where invalid (teacher rows there may hold
    anything, even -inf padding). The teacher is a constant.
    topk: sum only over the teacher's top-k tokens with their full-vocabulary probabilities, not
    renormalised (as the authors' `--draft-loss-topk`: a position weighs by the mass of its top-k);
    the minimiser is the same as with renormalised probabilities. This restricted sum can be < 0.
    """
    law = as_law(teacher)
    if topk is None:
        return _KLToSoftmax.apply(draft_logits, law.probs, law.neg_entropy, valid)
    log_q = F.log_softmax(at_least_fp32(draft_logits), dim=-1)  # [B,S,K,V]
    with torch.no_grad():
        p, idx = law.probs.topk(topk, dim=-1)  # [B,S,K,topk]
        p = p.masked_fill(~valid.unsqueeze(-1), 0.0)
        neg_entropy = torch.xlogy(p, p).sum(-1)
    return neg_entropy - (p * log_q.gather(-1, idx)).sum(-1)
