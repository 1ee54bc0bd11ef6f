"""Where verifiers get their randomness from.

Every verifier draws its coins and tokens through a small `Sampler` interface instead of calling
`torch.rand` directly. `TorchSampler` is the real thing (one `torch.Generator`, or torch's global
RNG). `specblock.evaluate.verify.exact.ExactSampler` implements the same three calls by walking every
outcome with its exact probability, which is how the tests prove each verifier lossless by exact
enumeration of the very code that runs in decoding.

The three calls are the only random decisions any verifier makes:
- `first_failure(a)`: independent coins, return the first i whose coin fails, or len(a)
  (token-wise speculative sampling's sequential accept loop),
- `bernoulli(a)`: one coin,
- `categorical(w)`: one token from non-negative weights w (normalised inside).
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch

# Acceptance arithmetic runs in float64, as vLLM does: float32 ratios of small probabilities lose
# the 1e-9 exactness the tests check.
ACC_DTYPE = torch.float64


class Sampler(Protocol):
    def first_failure(self, a: torch.Tensor) -> int: ...

    def bernoulli(self, a: float) -> bool: ...

    def categorical(self, weights: torch.Tensor) -> int: ...


class TorchSampler:
    """Draws every coin and token from one `torch.Generator` (None: torch's global RNG).

    Uniforms are drawn from the generator in blocks of UNIFORM_BLOCK and served in order: one call to
    the generator instead of one per coin (a verification flips up to K x L coins)."""

    UNIFORM_BLOCK = 64

    def __init__(self, generator: torch.Generator | None = None):
        self.generator = generator
        self._block: list[float] = []

    def _uniforms(self, n: int) -> list[float]:
        while len(self._block) < n:
            device = self.generator.device if self.generator is not None else torch.device("cpu")
            fresh = torch.rand(self.UNIFORM_BLOCK, generator=self.generator, dtype=ACC_DTYPE, device=device)
            self._block.extend(fresh.tolist())
        out, self._block = self._block[:n], self._block[n:]
        return out

    def _uniform(self, n: int, device: torch.device) -> torch.Tensor:
        return torch.tensor(self._uniforms(n), dtype=ACC_DTYPE, device=device)

    def first_failure(self, a: torch.Tensor) -> int:
        """a: [n] probabilities. Returns min{i : eta_i >= a_i} with eta i.i.d. U(0,1), or n."""
        misses = torch.nonzero(self._uniform(a.numel(), a.device) >= a)
        return int(misses[0]) if misses.numel() else a.numel()

    def bernoulli(self, a: float) -> bool:
        return self._uniforms(1)[0] < a

    def categorical(self, weights: torch.Tensor) -> int:
        """weights: [V] non-negative, not necessarily normalised, with a positive sum (any float dtype).

        Inverse-CDF sampling in float64: the first index whose cumulative weight exceeds u * total, so a
        zero-weight token can never be that index. Over a large vocabulary it runs in two levels (block
        sums, then the chosen block), one reduction pass instead of a float64 running sum over all of V
        (at V = 128k on our CPU: torch.multinomial about 2 ms, a float64 cumsum over V 80-700 us, this 40 us).
        """
        w = weights.reshape(-1)
        u = self._uniforms(1)[0]
        if w.numel() <= 2 * CATEGORICAL_BLOCK:
            cdf = torch.cumsum(w, 0, dtype=ACC_DTYPE)
            return _inverse_cdf(w, u * float(cdf[-1]), cdf)
        nb = w.numel() // CATEGORICAL_BLOCK
        sums = w[: nb * CATEGORICAL_BLOCK].view(nb, CATEGORICAL_BLOCK).sum(-1, dtype=ACC_DTYPE)
        if w.numel() > nb * CATEGORICAL_BLOCK:
            sums = torch.cat([sums, w[nb * CATEGORICAL_BLOCK :].sum(dtype=ACC_DTYPE).view(1)])
        cdf = torch.cumsum(sums, 0)
        x = u * float(cdf[-1])
        b = _inverse_cdf(sums, x, cdf)
        lo = b * CATEGORICAL_BLOCK
        return lo + _inverse_cdf(w[lo : lo + CATEGORICAL_BLOCK], x - (float(cdf[b - 1]) if b else 0.0))


# Block size of TorchSampler.categorical's two-level inverse CDF.
CATEGORICAL_BLOCK = 512


def _inverse_cdf(w: torch.Tensor, x: float, cdf: torch.Tensor | None = None) -> int:
    """The first index i with sum(w[:i+1]) > x (float64 running sums). If rounding puts x at or past the
    total (x = u * total with u just below 1), the last index of positive weight."""
    cdf = torch.cumsum(w, 0, dtype=ACC_DTYPE) if cdf is None else cdf
    i = int(torch.searchsorted(cdf, x, right=True))
    if i < w.numel():
        return i
    return int(torch.nonzero(w > 0)[-1])


def make_sampler(generator: torch.Generator | None, sampler: Sampler | None) -> Sampler:
    """The sampler a verifier uses: an explicit one (exact enumeration), else a TorchSampler."""
    return sampler if sampler is not None else TorchSampler(generator)


def residual(weights: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """Guarded normalisation of a residual law.

    weights: [..., V] non-negative (e.g. max(q - p, 0)); fallback: [..., V], used where a row sums to
    0. Such rows are reached with probability 0 (docs/verifiers.md section 10), so any law is fine there;
    the fallback only keeps the arithmetic finite.
    """
    total = weights.sum(-1, keepdim=True)
    return torch.where(total > 0, weights / total.clamp_min(torch.finfo(weights.dtype).tiny), fallback)


def backward_scan(sampler: Sampler, weight: Callable[[int], float], n: int) -> int:
    """tau = max{i in 1..n : eta_i < h_i}, else 0, scanning i = n..1 and computing h_i = weight(i) only
    when its coin is flipped (docs/verifiers.md section 1: the backward scan equals the max-form in law).
    The weights below the accepted length are never computed."""
    for i in range(n, 0, -1):
        if sampler.bernoulli(weight(i)):
            return i
    return 0


def first_success(sampler: Sampler, a: torch.Tensor) -> int:
    """min{i : eta_i < a_i} for independent coins, or len(a) if none succeeds.

    Equal in law to `first_failure(1 - a)`: eta >= 1 - a iff (1 - eta) <= a, and 1 - eta ~ U(0, 1).
    """
    return sampler.first_failure(1.0 - a)
