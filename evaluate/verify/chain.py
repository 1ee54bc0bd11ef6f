"""Single-draft verifiers: token-wise speculative sampling and block verification.

Both are iteration-independent: after them, the next iteration verifies against the plain target.
Acceptance arithmetic is float64; probabilities may come in any float dtype (residuals.py).
"""

from __future__ import annotations

import torch

from .base import VerifyOutput, check_inputs, register_verifier
from .residuals import draft_rows
from .randomness import ACC_DTYPE, Sampler, backward_scan, make_sampler


def path_probs(probs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """probs: [L', V] conditionals along a path, tokens: [L] with L <= L'. Returns [L] float64: the
    probability each row gives the path's next token, probs[i, tokens[i]]."""
    n = tokens.shape[0]
    return probs[:n].gather(-1, tokens[:, None].long()).squeeze(-1).to(ACC_DTYPE)


def clipped_ratio(q: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """min(1, q/p) elementwise, with q = 0 -> 0 and (q > 0, p = 0) -> 1 (no division by zero)."""
    safe = torch.where(p > 0, q / p.clamp_min(torch.finfo(p.dtype).tiny), torch.ones_like(q))
    return torch.where(q > 0, safe.clamp(max=1.0), torch.zeros_like(q))


@register_verifier("token", single_draft=True)
def token_verify(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    generator: torch.Generator | None = None,
    *,
    sampler: Sampler | None = None,
) -> VerifyOutput:
    """Token-wise speculative sampling (Leviathan et al. 2023; Chen et al. 2023), docs/verifiers.md s. 2.

    target_probs [1, L+1, V], draft_probs [1, L, V], draft_tokens [1, L].
    """
    _, n, _ = check_inputs(target_probs, draft_probs, draft_tokens, single=True)
    s = make_sampler(generator, sampler)
    q, p, x = target_probs[0], draft_probs[0], draft_tokens[0]
    # Accept X_i with probability min(1, q(X_i | X^{i-1}) / p(X_i | X^{i-1})), left to right.
    tau = s.first_failure(clipped_ratio(path_probs(q, x), path_probs(p, x)))
    if tau == n:  # every draft token accepted: bonus token from q(. | X^L)
        return VerifyOutput(tau, 0, s.categorical(q[n]))
    # Rejected at position tau+1: correction from the token-wise residual (q - p)_+ / TV(q, p).
    rows = draft_rows(target_probs, draft_probs, draft_tokens.tolist())
    return VerifyOutput(tau, 0, s.categorical(rows.residual(tuple(x[:tau].tolist()), 1.0)))


def block_ratios(q: torch.Tensor, p: torch.Tensor, x: torch.Tensor) -> list[float]:
    """Block verification's clipped running ratios p_0..p_L (Sun et al., ICLR 2025):
    p_0 = 1, p_i = min(1, p_{i-1} q(X_i|X^{i-1}) / p(X_i|X^{i-1})). q: [L+1, V], p: [L, V], x: [L]."""
    ratios = (path_probs(q, x) / path_probs(p, x)).tolist()  # inf where p(X_i) = 0 < q(X_i)
    run = [1.0]
    for r in ratios:  # a zero running ratio stays zero (avoids 0 * inf)
        run.append(0.0 if run[-1] == 0.0 else min(1.0, run[-1] * r))
    return run


@register_verifier("block", single_draft=True)
def block_verify(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    generator: torch.Generator | None = None,
    *,
    sampler: Sampler | None = None,
) -> VerifyOutput:
    """Block verification (Sun, Mendlovic, Leviathan et al., ICLR 2025), docs/verifiers.md section 3.

    target_probs [1, L+1, V], draft_probs [1, L, V], draft_tokens [1, L]. Optimal among
    iteration-independent single-draft verifiers; the correction comes from max(p_tau q - p, 0), NOT
    from the token-wise residual (the vllm-ascend #7807 bug).
    """
    _, n, _ = check_inputs(target_probs, draft_probs, draft_tokens, single=True)
    s = make_sampler(generator, sampler)
    q, p, x = target_probs[0], draft_probs[0], draft_tokens[0]
    run = block_ratios(q, p, x)
    rows, prefixes = (
        draft_rows(target_probs, draft_probs, draft_tokens.tolist()),
        [tuple(x[:i].tolist()) for i in range(n)],
    )

    # h_i = Z_i / (Z_i + 1 - p_i) for i = 1..L-1, h_L = p_L; tau = max{i : eta_i < h_i}, 0 if none.
    # Z_i = sum_x max(p_i q(x|X^i) - p(x|X^i), 0) = p_i S(1 / p_i), the residual mass at position i+1.
    # p_i = 1 gives h_i = 1 (the denominator is Z_i itself, or 0 on a branch of probability 0).
    def weight(i: int) -> float:
        if i == n or run[i] >= 1.0 or run[i] <= 0.0:
            return run[i]
        z = run[i] * rows.mass(prefixes[i], 1.0 / run[i])
        return z / (z + 1.0 - run[i])

    tau = backward_scan(s, weight, n)
    if tau == n:
        return VerifyOutput(tau, 0, s.categorical(q[n]))
    if run[tau] == 0.0:  # (0 q - p)_+ = 0: a branch of probability 0, any law will do
        return VerifyOutput(tau, 0, s.categorical(q[tau]))
    return VerifyOutput(tau, 0, s.categorical(rows.residual(prefixes[tau], 1.0 / run[tau])))
