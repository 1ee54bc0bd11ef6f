"""The calling convention shared by every chain and multi-draft verifier, and their registry.

```
out = verifier(target_probs,   # [K, L+1, V]: target_probs[k, i] = q(. | context, draft k's first i tokens)
               draft_probs,    # [K, L, V]:   draft_probs[k, i]  = p(. | context, draft k's first i tokens)
               draft_tokens,   # [K, L] int64, drafts sampled i.i.d. from p
               generator=None) # torch.Generator: all randomness comes from it
```
Notation follows docs/verifiers.md: q is the TARGET law, p the DRAFT law, tau the number of accepted draft
tokens (the correction/bonus token is not counted).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from .randomness import Sampler

# A law lookup along a prefix (tokens counted from the block start): returns a [V] probability vector.
LawAt = Callable[[tuple[int, ...]], torch.Tensor]


class Continuation(Protocol):
    def __call__(
        self, prefix: tuple[int, ...], target_probs_at: LawAt, draft_probs_at: LawAt
    ) -> torch.Tensor:
        """The [V] law the NEXT iteration must verify against after `prefix`.

        prefix: tokens from this block's start, beginning with the tokens this iteration emitted.
        target_probs_at(y): the law THIS iteration verified against after y (the plain target unless an
        earlier continuation is still in force); draft_probs_at(y): this iteration's draft law after y.
        Beyond the block horizon (len(prefix) >= L) the continuation is target_probs_at(prefix).
        """


@dataclass(frozen=True)
class VerifyOutput:
    num_accepted: int  # tau in 0..L
    draft_index: int  # k: the accepted tokens are draft_tokens[k, :tau]
    next_token: int  # correction (tau < L) or bonus (tau = L)
    continuation: Continuation | None = None  # None: the next iteration verifies against the plain target


class Verifier(Protocol):
    def __call__(
        self,
        target_probs: torch.Tensor,
        draft_probs: torch.Tensor,
        draft_tokens: torch.Tensor,
        generator: torch.Generator | None = None,
        *,
        sampler: Sampler | None = None,
    ) -> VerifyOutput: ...


VERIFIERS: dict[str, Verifier] = {}
# Verifiers whose next iteration must use the returned continuation (cross-iteration methods).
CROSS_ITERATION: set[str] = set()
# Verifiers that accept only a single draft (K = 1).
SINGLE_DRAFT: set[str] = set()


def register_verifier(name: str, *, single_draft: bool = False, cross_iteration: bool = False):
    """Decorator: add a verifier to the registry under `name`."""

    def wrap(fn: Verifier) -> Verifier:
        if name in VERIFIERS:
            raise ValueError(f"verifier {name!r} is registered twice")
        VERIFIERS[name] = fn
        if single_draft:
            SINGLE_DRAFT.add(name)
        if cross_iteration:
            CROSS_ITERATION.add(name)
        return fn

    return wrap


def get_verifier(name: str) -> Verifier:
    try:
        return VERIFIERS[name]
    except KeyError:
        raise KeyError(f"unknown verifier {name!r}; registered: {sorted(VERIFIERS)}") from None


def check_inputs(
    target_probs: torch.Tensor, draft_probs: torch.Tensor, draft_tokens: torch.Tensor, *, single: bool = False
) -> tuple[int, int, int]:
    """Validate the calling convention and return (K, L, V)."""
    if target_probs.dim() != 3 or draft_probs.dim() != 3 or draft_tokens.dim() != 2:
        raise ValueError(
            "expected target_probs [K, L+1, V], draft_probs [K, L, V], draft_tokens [K, L]; got "
            f"{tuple(target_probs.shape)}, {tuple(draft_probs.shape)}, {tuple(draft_tokens.shape)}"
        )
    k, n, v = draft_probs.shape
    if tuple(target_probs.shape) != (k, n + 1, v) or tuple(draft_tokens.shape) != (k, n):
        raise ValueError(
            f"shape mismatch: draft_probs {tuple(draft_probs.shape)} needs target_probs {(k, n + 1, v)} "
            f"and draft_tokens {(k, n)}; got {tuple(target_probs.shape)} and {tuple(draft_tokens.shape)}"
        )
    if single and k != 1:
        raise ValueError(f"this verifier takes a single draft (K = 1), got K = {k}")
    if draft_tokens.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"draft_tokens must be an integer tensor, got {draft_tokens.dtype}")
    return k, n, v
