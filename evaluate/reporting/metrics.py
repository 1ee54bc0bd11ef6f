"""Evaluation metrics as ratios of global sums (STYLE habit 13), independent of the decoding loop.

The loop records raw sums and counts per (dataset, method) in an `Accumulator` of typed `Counts`; ranks
or processes exchange `to_dict()` and add them with `merge` *before* any division (the division and the
padded addition are `specblock.train.ratios`, which training's metrics use too). Every derived number is then one
ratio of two global sums: never a mean of per-generation, per-batch or per-dataset ratios. The "overall"
row of a method sums its datasets' counts, so a long dataset weighs by its iterations, not as one vote.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, Iterable

from specblock.train.ratios import add_padded, ratio  # the one implementation (training's too)

AUTOREGRESSIVE = "autoregressive"  # plain decoding in the evaluation's precision (the greedy reference)
# Plain decoding in another precision, run beside it: "autoregressive@float32" (EvalConfig.baseline_dtypes).
BASELINE_SEP = "@"
OVERALL = "overall"  # the dataset name of a method's all-datasets row


def is_autoregressive(method: str) -> bool:
    """Plain decoding, in the evaluation's precision or another one (a speedup's candidate denominator)."""
    return method == AUTOREGRESSIVE or method.startswith(AUTOREGRESSIVE + BASELINE_SEP)


@dataclass
class Counts:
    """Raw sums for one (dataset, method); add them, never their ratios.

    Iteration sums (one verification step of the target): `iterations`, `accepted` draft tokens,
    `emitted` tokens (accepted + the target's bonus/correction token, so `accepted + 1` per plain
    step), `target_calls` (target forward passes), `drafter_calls`, `drafter_seconds`, `verify_seconds`,
    `target_seconds` (target forwards; the prefill's and every autoregressive step's come with the
    generation, as do the drafter's first advance at the prefill).
    Generation sums: `generations`, `tokens` (new tokens kept), `wall_seconds` (end-to-end); what the
    wall time holds beyond drafting, target forwards and verification is the overhead.
    `accepted_at[i]` = iterations that accepted at least i+1 draft tokens; `offered_at[i]` = iterations
    whose draft had a position i+1 (draft length > i).
    """

    iterations: int = 0
    accepted: int = 0
    emitted: int = 0
    target_calls: int = 0
    drafter_calls: int = 0
    drafter_seconds: float = 0.0
    verify_seconds: float = 0.0
    target_seconds: float = 0.0
    generations: int = 0
    tokens: int = 0
    wall_seconds: float = 0.0
    accepted_at: list[int] = field(default_factory=list)
    offered_at: list[int] = field(default_factory=list)

    def __add__(self, other: Counts) -> Counts:
        sums = {
            f.name: getattr(self, f.name) + getattr(other, f.name)
            for f in fields(self)
            if f.name not in ("accepted_at", "offered_at")
        }
        return Counts(
            **sums,
            accepted_at=add_padded(self.accepted_at, other.accepted_at),
            offered_at=add_padded(self.offered_at, other.offered_at),
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Counts:
        """Inverse of `to_dict`; unknown keys are an error (a renamed field must not vanish silently)."""
        return cls(**{k: list(v) if isinstance(v, list) else v for k, v in d.items()})


def tau(c: Counts) -> float | None:
    """Acceptance length: Σ accepted draft tokens / Σ iterations (the bonus token NOT counted)."""
    return ratio(c.accepted, c.iterations)


def block_efficiency(c: Counts) -> float | None:
    """Tokens per target call: Σ emitted / Σ target calls. The +1 bonus/correction token IS counted, so a
    chain drafter with one call per iteration has block efficiency tau + 1; autoregressive decoding is 1."""
    return ratio(c.emitted, c.target_calls)


def acceptance_at(c: Counts) -> list[float | None]:
    """Per-position acceptance: entry i = Σ iterations accepting ≥ i+1 tokens / Σ iterations offering
    position i+1, i.e. the rate at which position i+1 is accepted among drafts that reached it."""
    accepted = add_padded(c.accepted_at, [0] * len(c.offered_at))  # padded: accepted_at may be shorter
    return [ratio(accepted[i], offered) for i, offered in enumerate(c.offered_at)]


def tokens_per_second(c: Counts) -> float | None:
    """Wall-clock throughput: Σ new tokens / Σ wall seconds of the generations."""
    return ratio(c.tokens, c.wall_seconds)


def overhead_seconds(c: Counts) -> float:
    """Σ wall seconds not spent drafting, in target forwards or verifying (bookkeeping, cache gathers,
    sampling): what an optimised loop could still save."""
    return c.wall_seconds - c.drafter_seconds - c.target_seconds - c.verify_seconds


def derived(c: Counts) -> dict[str, Any]:
    """All ratios of one Counts (speedup needs the reference, see `Accumulator.speedup`)."""
    return {
        "tau": tau(c),
        "block_efficiency": block_efficiency(c),
        "drafter_calls_per_token": ratio(c.drafter_calls, c.emitted),  # Σ drafter calls / Σ emitted
        "drafter_seconds_per_token": ratio(c.drafter_seconds, c.emitted),  # Σ drafter s / Σ emitted
        "verify_seconds_per_token": ratio(c.verify_seconds, c.emitted),  # Σ verification s / Σ emitted
        "target_seconds_per_token": ratio(c.target_seconds, c.emitted),  # Σ target forward s / Σ emitted
        "overhead_seconds_per_token": ratio(overhead_seconds(c), c.emitted),
        "tokens_per_second": tokens_per_second(c),
        "acceptance_at": acceptance_at(c),
    }


class Accumulator:
    """Sums and counts keyed by (dataset, method). Add iterations and generations, merge across ranks,
    then read ratios. Keys keep their first-seen order, which reports use for rows and columns."""

    def __init__(self) -> None:
        self.counts: dict[tuple[str, str], Counts] = {}

    def _get(self, dataset: str, method: str) -> Counts:
        if dataset == OVERALL:
            raise ValueError(f"dataset name {OVERALL!r} is reserved for the all-datasets row")
        return self.counts.setdefault((dataset, method), Counts())

    def add_iteration(
        self,
        dataset: str,
        method: str,
        *,
        accepted: int,
        emitted: int,
        draft_len: int,
        drafter_calls: int,
        drafter_seconds: float = 0.0,
        verify_seconds: float = 0.0,
        target_calls: int = 1,
        target_seconds: float = 0.0,
    ) -> None:
        """One verification step: `accepted` draft tokens kept out of a draft of depth `draft_len`
        (the longest path for a tree), `emitted` tokens appended (accepted + bonus/correction)."""
        if not 0 <= accepted <= draft_len:
            raise ValueError(f"accepted={accepted} outside [0, draft_len={draft_len}]")
        c = self._get(dataset, method)
        c.iterations += 1
        c.accepted += accepted
        c.emitted += emitted
        c.target_calls += target_calls
        c.drafter_calls += drafter_calls
        c.drafter_seconds += drafter_seconds
        c.verify_seconds += verify_seconds
        c.target_seconds += target_seconds
        c.accepted_at = add_padded(c.accepted_at, [1] * accepted)
        c.offered_at = add_padded(c.offered_at, [1] * draft_len)

    def add_generation(
        self,
        dataset: str,
        method: str,
        *,
        tokens: int,
        seconds: float,
        target_calls: int = 0,
        target_seconds: float = 0.0,
        drafter_calls: int = 0,
        drafter_seconds: float = 0.0,
    ) -> None:
        """One finished generation of `tokens` new tokens in `seconds` of wall clock. `target_calls` are
        target forwards NOT recorded by `add_iteration` (the prefill; every step of autoregressive
        decoding): each emits exactly one token, so they add to both `target_calls` and `emitted`;
        `target_seconds` their time; `drafter_*` the drafter's work outside iterations (its prefill)."""
        c = self._get(dataset, method)
        c.generations += 1
        c.tokens += tokens
        c.wall_seconds += seconds
        c.target_calls += target_calls
        c.emitted += target_calls
        c.target_seconds += target_seconds
        c.drafter_calls += drafter_calls
        c.drafter_seconds += drafter_seconds

    def merge(self, other: Accumulator) -> Accumulator:
        """A new accumulator holding the key-wise sums of both (either may lack some keys)."""
        out = Accumulator()
        for src in (self, other):
            for key, c in src.counts.items():
                out.counts[key] = out.counts.get(key, Counts()) + c
        return out

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form, for `all_gather_object` or a file; see `gather`."""
        return {"counts": [{"dataset": d, "method": m, **c.to_dict()} for (d, m), c in self.counts.items()]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Accumulator:
        acc = cls()
        for row in d["counts"]:
            row = dict(row)
            key = (row.pop("dataset"), row.pop("method"))
            acc.counts[key] = Counts.from_dict(row)
        return acc

    @classmethod
    def gather(cls, parts: Iterable[dict[str, Any]]) -> Accumulator:
        """Sum the `to_dict()` of every rank (e.g. the list from `all_gather_object`)."""
        acc = cls()
        for part in parts:
            acc = acc.merge(cls.from_dict(part))
        return acc

    def datasets(self) -> list[str]:
        return list(dict.fromkeys(d for d, _ in self.counts))

    def methods(self) -> list[str]:
        return list(dict.fromkeys(m for _, m in self.counts))

    def get(self, dataset: str, method: str) -> Counts | None:
        """The counts of one cell; for dataset == OVERALL, the sum over the method's datasets."""
        if dataset != OVERALL:
            return self.counts.get((dataset, method))
        parts = [c for (_, m), c in self.counts.items() if m == method]
        return sum(parts, Counts()) if parts else None

    def reference(self) -> str:
        """The speedups' denominator: of the autoregressive runs (one per precision), the one with the most
        tokens/s overall, so that a speedup counts against the fastest plain decoding of the target.
        AUTOREGRESSIVE when no run has timings."""
        best, name = None, AUTOREGRESSIVE
        for m in self.methods():
            tps = tokens_per_second(self.get(OVERALL, m)) if is_autoregressive(m) else None
            if tps is not None and (best is None or tps > best):
                best, name = tps, m
        return name

    def speedup(self, dataset: str, method: str, reference: str | None = None) -> float | None:
        """tokens/s of `method` / tokens/s of `reference` (default: `self.reference()`, the fastest plain
        decoding) on the same dataset (or both overall)."""
        c, ref = self.get(dataset, method), self.get(dataset, reference or self.reference())
        if c is None or ref is None:
            return None
        num, den = tokens_per_second(c), tokens_per_second(ref)
        return ratio(num, den) if num is not None and den is not None else None

    def cells(self) -> list[tuple[str, str, Counts]]:
        """(dataset, method, counts) for every recorded cell, then every method's OVERALL row."""
        rows = [(d, m, c) for (d, m), c in self.counts.items()]
        return rows + [(OVERALL, m, self.get(OVERALL, m)) for m in self.methods()]
