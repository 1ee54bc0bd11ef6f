"""Exact evaluation of verifiers on small table models, by enumerating every random outcome.

This runs the very verifier code used in decoding, with an `ExactSampler` in place of the
`TorchSampler`: each random call branches over all its outcomes with their exact probabilities (a
replay search over the choice sequence), and each draft tuple is enumerated with its probability. It
gives, to float64 precision:
- `iteration_law`: the law of the first L+1 tokens after one iteration, completed with the
  continuation law where the verifier returns one (the losslessness check), and E[tau];
- `decode_law`: the law of the first H tokens of whole decodes and the expected number of target calls
  needed to emit them, with continuations carried across iterations (what decides which verifier is
  faster: first-iteration tau alone misleads for the greedy methods, docs/verifiers.md section 4).
Cost grows as (V^L)^K x outcomes: meant for V <= 6, L <= 3, K <= 3.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from .base import Verifier
from .randomness import ACC_DTYPE

Prefix = tuple[int, ...]
# Below this a branch's probability is treated as 0 (docs/verifiers.md section 10: prune below 1e-15).
PRUNE = 1e-15


class ExactSampler:
    """Follows a scripted choice sequence; at new choice points takes option 0 and records the rest."""

    def __init__(self, script: list[int]):
        self.script, self.taken, self.options, self.weight = script, [], [], 1.0

    def _choose(self, outcomes: list[tuple[Any, float]]) -> Any:
        outcomes = [(v, w) for v, w in outcomes if w > PRUNE]
        pos = len(self.taken)
        pick = self.script[pos] if pos < len(self.script) else 0
        self.taken.append(pick)
        self.options.append(len(outcomes))
        value, w = outcomes[pick]
        self.weight *= w
        return value

    def first_failure(self, a: torch.Tensor) -> int:
        a = [min(max(float(v), 0.0), 1.0) for v in a.tolist()]
        outcomes, head = [], 1.0  # P(first failure = i) = prod_{j < i} a_j (1 - a_i)
        for i, ai in enumerate(a):
            outcomes.append((i, head * (1.0 - ai)))
            head *= ai
        outcomes.append((len(a), head))
        return self._choose(outcomes)

    def bernoulli(self, a: float) -> bool:
        a = min(max(float(a), 0.0), 1.0)
        return self._choose([(True, a), (False, 1.0 - a)])

    def categorical(self, weights: torch.Tensor) -> int:
        w = weights.to(ACC_DTYPE)
        w = (w / w.sum()).tolist()
        return self._choose(list(enumerate(w)))


def enumerate_outcomes(fn: Callable[[ExactSampler], Any]) -> list[tuple[float, Any]]:
    """Run fn once per path of random choices; returns [(probability, fn's result)]."""
    results, stack = [], [[]]
    while stack:
        script = stack.pop()
        s = ExactSampler(script)
        out = fn(s)
        results.append((s.weight, out))
        for pos in range(len(script), len(s.taken)):
            stack.extend(s.taken[:pos] + [alt] for alt in range(1, s.options[pos]))
    return results


@dataclass
class TableModel:
    """A tiny autoregressive model: law(prefix) -> [V] float64, random but fixed per (seed, prefix).

    alpha: Dirichlet concentration (small = peaked); sparsity: chance that a token gets probability 0
    (one token always keeps its mass); greedy: one-hot laws (temperature 0 targets).
    `fixed` makes the law the same after every prefix (the block-verification paper's toy example).
    """

    vocab: int
    seed: int = 0
    alpha: float = 1.0
    sparsity: float = 0.0
    greedy: bool = False
    fixed: list[float] | None = None
    _cache: dict = field(default_factory=dict, repr=False)

    def __call__(self, prefix: Prefix) -> torch.Tensor:
        prefix = tuple(prefix)
        if prefix not in self._cache:
            self._cache[prefix] = self._make(prefix)
        return self._cache[prefix]

    def _make(self, prefix: Prefix) -> torch.Tensor:
        if self.fixed is not None:
            return torch.tensor(self.fixed, dtype=ACC_DTYPE)
        rng = np.random.default_rng([self.seed, len(prefix), *prefix])
        w = rng.dirichlet(np.full(self.vocab, self.alpha))
        if self.sparsity > 0:
            keep = rng.random(self.vocab) >= self.sparsity
            keep[int(np.argmax(w))] = True
            w = w * keep
        if self.greedy:
            w = np.eye(self.vocab)[int(np.argmax(w))]
        return torch.tensor(w / w.sum(), dtype=ACC_DTYPE)


def sequences(
    model: Callable[[Prefix], torch.Tensor], length: int, start: Prefix = ()
) -> list[tuple[Prefix, float]]:
    """Every continuation z of `length` tokens after `start` with its probability under `model`."""
    out: list[tuple[Prefix, float]] = [((), 1.0)]
    for _ in range(length):
        grown = []
        for z, w in out:
            law = model(start + z).tolist()
            grown.extend((z + (t,), w * pt) for t, pt in enumerate(law) if w * pt > PRUNE)
        out = grown
    return out


def continuation_key(cont: Any) -> Any:
    """A hashable identity for a continuation: equal keys give equal laws (object identity otherwise)."""
    return cont.cache_key() if hasattr(cont, "cache_key") else ("id", id(cont))


@dataclass(frozen=True)
class Outcome:
    prob: float
    emitted: Prefix  # accepted draft tokens + the correction/bonus token
    num_accepted: int
    continuation: Any


def iteration_outcomes(
    verifier: Verifier, target_at, draft_at, num_drafts: int, length: int
) -> list[Outcome]:
    """Every (draft tuple, random path) of one verification call, merged by (emitted, continuation)."""
    singles = sequences(draft_at, length)
    merged: dict[tuple, list] = {}
    for combo in itertools.product(singles, repeat=num_drafts):
        prob = 1.0
        for _, w in combo:
            prob *= w
        tokens = torch.tensor([z for z, _ in combo], dtype=torch.int64)
        rows = [[z[:i] for i in range(length + 1)] for z, _ in combo]
        tp = torch.stack([torch.stack([target_at(y) for y in r]) for r in rows])
        dp = torch.stack([torch.stack([draft_at(y) for y in r[:length]]) for r in rows])
        for w, out in enumerate_outcomes(lambda s: verifier(tp, dp, tokens, sampler=s)):
            emitted = tuple(tokens[out.draft_index, : out.num_accepted].tolist()) + (out.next_token,)
            key = (emitted, out.num_accepted, continuation_key(out.continuation))
            slot = merged.setdefault(key, [0.0, out.continuation])
            slot[0] += prob * w
    return [Outcome(p, key[0], key[1], cont) for key, (p, cont) in merged.items()]


def expected_accepted(outcomes: list[Outcome]) -> float:
    return sum(o.prob * o.num_accepted for o in outcomes)


def iteration_law(outcomes: list[Outcome], target_at, draft_at, length: int) -> dict[Prefix, float]:
    """Law of the first L+1 tokens: the emitted prefix completed by the continuation (or the target)."""
    law: dict[Prefix, float] = {}
    for o in outcomes:
        nxt = target_at
        if o.continuation is not None:
            nxt = lambda y, c=o.continuation: c(y, target_at, draft_at)  # noqa: E731
        for z, w in sequences(nxt, length + 1 - len(o.emitted), start=o.emitted):
            law[o.emitted + z] = law.get(o.emitted + z, 0.0) + o.prob * w
    return law


def law_error(law: dict[Prefix, float], target_at, length: int) -> float:
    """max |law - Q| over all sequences of `length` tokens (Q: the target's joint law)."""
    ref = dict(sequences(target_at, length))
    return max(abs(law.get(y, 0.0) - ref.get(y, 0.0)) for y in set(law) | set(ref))


@dataclass(frozen=True)
class DecodeResult:
    law: dict[Prefix, float]  # law of the first H tokens
    target_calls: float  # expected verification calls (= target forwards) to emit H tokens
    tokens_per_call: float  # H / target_calls


def decode_law(verifier: Verifier, target, draft, num_drafts: int, length: int, horizon: int) -> DecodeResult:
    """Exact whole decodes of `horizon` tokens from the empty context, continuations carried across
    iterations: iteration n verifies against law_n, which is the target modified by the continuations
    still in force (a continuation covers its block's horizon, then the plain target takes over)."""
    memo: dict[tuple, tuple[dict, float]] = {}

    def run(y: Prefix, law, key) -> tuple[dict, float]:
        if len(y) >= horizon:
            return {y[:horizon]: 1.0}, 0.0
        if (y, key) in memo:
            return memo[(y, key)]
        block_target = lambda z: law(y + z)  # noqa: E731
        block_draft = lambda z: draft(y + z)  # noqa: E731
        result: dict[Prefix, float] = {}
        calls = 1.0
        for o in iteration_outcomes(verifier, block_target, block_draft, num_drafts, length):
            y2 = y + o.emitted
            law2, key2 = law, key
            if o.continuation is not None:
                law2 = lambda w, c=o.continuation, bt=block_target, bd=block_draft, n=len(y): c(w[n:], bt, bd)  # noqa: E731
                key2 = (len(y) + length, continuation_key(o.continuation), key)
            if key2 and len(y2) >= key2[0]:  # past the newest horizon every law in force is the target
                law2, key2 = target, ()
            sub, sub_calls = run(y2, law2, key2)
            for seq, w in sub.items():
                result[seq] = result.get(seq, 0.0) + o.prob * w
            calls += o.prob * sub_calls
        memo[(y, key)] = (result, calls)
        return result, calls

    law, calls = run((), target, ())
    return DecodeResult(law, calls, horizon / calls)
