"""Prompt-lookup (n-gram) drafting: no drafter, drafts copied from the context itself.

The rule (prompt lookup decoding, Saxena 2023; `prompt_lookup_num_tokens` in transformers): take the
longest suffix n-gram of the context, n from `max_ngram` down to `min_ngram`, that occurred earlier in
the context, and propose the up to L tokens that followed its MOST RECENT earlier occurrence; no match,
no draft (the iteration is a plain target step). The context is the prompt plus the tokens generated so
far, so repeated spans of the prompt (code, quoted text) and of the answer itself are drafted for free.

With `datastore` set, a context without a match drafts from the target's own answers in a data folder
instead (datastore.py). The draft is a point mass (a deterministic function of the context), so it is
verified exactly by token-wise speculative sampling with a one-hot draft law: accept x w.p.
min(1, q(x) / 1) = q(x), on rejection sample from (q - delta_x)_+ normalised, i.e. q with x removed (the
`token` verifier).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from specblock.evaluate.decoding.datastore import load_datastore
from specblock.evaluate.decoding.drafting import DraftCost


@dataclass
class LookupConfig:
    """max_ngram / min_ngram: the longest and shortest suffix n-gram tried (longest first). datastore: a
    data-stage folder (or its tokens/ folder) made for this target, whose answers the draft comes from where
    the context has no match (datastore.py); datastore_max_ngram / datastore_min_ngram: the n-grams it
    indexes."""

    max_ngram: int = 3
    min_ngram: int = 1
    datastore: str | None = None
    datastore_max_ngram: int = 4
    datastore_min_ngram: int = 2

    def __post_init__(self):
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(
                f"lookup needs 1 <= min_ngram <= max_ngram, got {self.min_ngram}..{self.max_ngram}"
            )
        if not 1 <= self.datastore_min_ngram <= self.datastore_max_ngram:
            raise ValueError(
                "lookup needs 1 <= datastore_min_ngram <= datastore_max_ngram, got "
                f"{self.datastore_min_ngram}..{self.datastore_max_ngram}"
            )


def ngram_draft(context: list[int], max_ngram: int, min_ngram: int, length: int) -> list[int]:
    """The reference rule by direct search (module docstring): up to `length` tokens, [] on no match.
    An earlier occurrence is one that ends before the last token, so its continuation is non-empty."""
    for n in range(min(max_ngram, len(context) - 1), min_ngram - 1, -1):
        suffix = context[-n:]
        for end in range(len(context) - 1, n - 1, -1):  # occurrence context[end-n:end], newest first
            if context[end - n : end] == suffix:
                return context[end : end + length]
    return []


class NgramIndex:
    """The same rule, incrementally: `next_of[g]` = the position after the most recent occurrence of
    n-gram g that has a successor. Appending one token updates max_ngram - min_ngram + 1 entries, so a
    draft costs O(max_ngram) dictionary reads instead of a scan of the context."""

    def __init__(self, max_ngram: int, min_ngram: int):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.tokens: list[int] = []
        self.next_of: dict[tuple[int, ...], int] = {}
        self.matched = 0  # the length of the suffix n-gram the last draft followed (0: no match)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: list[int]) -> None:
        for t in tokens:
            end = len(self.tokens)  # the n-grams ending just before `t` now have a successor at `end`
            for n in range(self.min_ngram, min(self.max_ngram, end) + 1):
                self.next_of[tuple(self.tokens[end - n : end])] = end
            self.tokens.append(t)

    def draft(self, length: int) -> list[int]:
        """Up to `length` tokens after the newest earlier occurrence of the longest matching suffix."""
        for n in range(min(self.max_ngram, len(self.tokens) - 1), self.min_ngram - 1, -1):
            start = self.next_of.get(tuple(self.tokens[-n:]))
            if start is not None:
                self.matched = n
                return self.tokens[start : start + length]
        self.matched = 0
        return []


class LookupSession:
    """The loop's drafting state for `lookup` (one per decoder, reset per generation). Its `cost` counts
    no drafter calls, only the seconds spent matching, which reports show as drafting time. With a
    datastore the context's own match comes first; where it has none, the datastore's (datastore.py)."""

    def __init__(self, cfg: LookupConfig, length: int):
        self.cfg, self.length = cfg, length
        self.cost = DraftCost()
        self.index = NgramIndex(cfg.max_ngram, cfg.min_ngram)
        self.datastore = (
            load_datastore(cfg.datastore, cfg.datastore_max_ngram, cfg.datastore_min_ngram, length)
            if cfg.datastore
            else None
        )
        self.matched = 0  # the last draft's match: n (the context's n-gram), -n (the datastore's), 0 (none)

    def reset(self) -> None:
        self.cost = DraftCost()
        self.index = NgramIndex(self.cfg.max_ngram, self.cfg.min_ngram)
        self.matched = 0

    def advance(self, features, tokens, position) -> None:
        """The loop's hook after each verification: nothing to do, the context comes with every draft."""
        return None

    def draft(self, context: list[int], datastore: bool = True) -> list[int]:
        """The draft after `context` (the prompt + every generated token; it only grows within a
        generation, so only its new tail is indexed); the datastore's where the context has no match
        (unless `datastore` is False)."""
        start = time.perf_counter()
        self.index.extend(context[len(self.index) :])
        out, self.matched = self.index.draft(self.length), self.index.matched
        self.cost.seconds += time.perf_counter() - start
        if out or not datastore:
            return out
        return self.datastore_draft(context)

    def datastore_draft(self, context: list[int]) -> list[int]:
        """The datastore's draft after `context` ([] without a datastore); `matched` = -n."""
        if self.datastore is None:
            return []
        start = time.perf_counter()
        n, out = self.datastore.draft(context, self.length)
        self.matched = -n
        self.cost.seconds += time.perf_counter() - start
        return out
