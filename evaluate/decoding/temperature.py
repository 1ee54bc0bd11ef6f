"""Next-token laws from logits: temperature and top-p, applied identically to the draft and the target.

Speculative decoding preserves the law the target SAMPLES from; with temperature or nucleus sampling
that law is the transformed one, so the verifier must receive the transformed target law and the
draft law the drafter really sampled from (transformed the same way, on its own logits).
"""

from __future__ import annotations

import torch

GREEDY = 0.0  # temperature 0: a one-hot law on the argmax (first index on ties, as torch.argmax)


def next_token_law(logits: torch.Tensor, temperature: float = 1.0, top_p: float = 1.0) -> torch.Tensor:
    """logits [..., V] -> probabilities [..., V] (float32).

    temperature 0 gives one-hot(argmax); else softmax(logits / temperature), then, if top_p < 1, the
    smallest set of most probable tokens whose mass reaches top_p (ties kept in index order), renormalised.
    """
    if temperature < 0 or not 0 < top_p <= 1:
        raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1, got {temperature}, {top_p}")
    logits = logits.float()
    if temperature == GREEDY:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p >= 1.0:
        return probs
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass strictly before each token
    keep_sorted = before < top_p  # the token that crosses top_p is kept, the ones after it are not
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    kept = probs * keep
    return kept / kept.sum(-1, keepdim=True)
