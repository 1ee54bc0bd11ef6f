"""A datastore of the target's own answers behind prompt lookup (`lookup.datastore`).

Prompt lookup drafts only where the context repeats itself; on a new turn of phrase it drafts nothing and
the iteration is a plain target step. The data stage already holds text the target wrote: its regenerated
answers. A datastore indexes them by n-gram: for every n-gram (n from `datastore_max_ngram` down to
`datastore_min_ngram`) the continuation of up to `length` tokens that followed it most often in those
answers (the most frequent; ties to the one that occurs first). Where the context has no match of its own,
lookup drafts the continuation of the longest suffix n-gram the datastore knows (REST, He et al. 2024, and
SGLang's n-gram cache draft from past text the same way). The draft stays a deterministic function of the
context, so every verifier that takes lookup's point-mass draft keeps the target's law.

Storage: per n, the n-grams packed exactly into uint64 keys (`bits` per token id, n * bits <= 64: any
n-gram of a 49k vocabulary up to 4 tokens, of a 128k one up to 3), sorted, and an int32 [keys, length]
table of continuations padded with -1. A draft is one binary search per n tried.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Iterable

import numpy as np
from specblock.data.manifest import check, read_manifest
from specblock.data.shards import TokenDataset

log = logging.getLogger(__name__)

PAD = -1  # continuation padding past the end of an answer
KEY_BITS = 64  # the packed key's width (uint64)
HASH_MULTIPLIER = 0x9E3779B97F4A7C15  # an odd 64-bit constant (2^64 / golden ratio) for the continuation hash


def token_bits(max_id: int) -> int:
    """Bits per token id in a packed n-gram key."""
    return max(1, int(max_id).bit_length())


class Datastore:
    """n-gram -> most frequent continuation over token sequences (module docstring)."""

    def __init__(self, tables: dict[int, tuple[np.ndarray, np.ndarray]], bits: int, length: int, tokens: int):
        self.tables, self.bits, self.length, self.tokens = tables, bits, length, tokens
        self.orders = sorted(tables, reverse=True)  # longest first

    @classmethod
    def build(
        cls, sequences: Iterable[Iterable[int]], max_ngram: int, min_ngram: int, length: int
    ) -> Datastore:
        """sequences: token ids (each an answer; n-grams never cross two of them). length: the longest
        continuation kept (drafts are cut to what the loop asks)."""
        seqs = [
            np.asarray(list(s) if not isinstance(s, np.ndarray) else s, dtype=np.int64) for s in sequences
        ]
        seqs = [s for s in seqs if len(s) >= 2]
        if not seqs:
            raise ValueError("a datastore needs at least one sequence of two or more tokens")
        max_id = max(int(s.max()) for s in seqs)
        bits = token_bits(max_id)
        if max_ngram * bits > KEY_BITS:
            raise ValueError(
                f"datastore_max_ngram={max_ngram}: n-grams of token ids below {max_id + 1} pack into 64 bits "
                f"only up to n = {KEY_BITS // bits}"
            )
        # every answer followed by `length` pads, end to end: a window that holds a pad is not an n-gram
        flat = np.concatenate([np.concatenate([s, np.full(length, PAD)]) for s in seqs])
        tables = {n: _table(flat, n, bits, length) for n in range(min_ngram, max_ngram + 1)}
        return cls(tables, bits, length, sum(len(s) for s in seqs))

    def draft(self, context: list[int], length: int) -> tuple[int, list[int]]:
        """(n, the continuation of up to `length` tokens) of the longest suffix n-gram of `context` the
        datastore holds; (0, []) where none."""
        for n in self.orders:
            if len(context) < n:
                continue
            gram = context[-n:]
            if max(gram) >> self.bits:  # an id no answer holds: no n-gram with it either
                continue
            keys, conts = self.tables[n]
            key = np.uint64(_pack_one(gram, self.bits))
            i = int(np.searchsorted(keys, key))
            if i < len(keys) and keys[i] == key:
                row = conts[i, : min(length, self.length)]
                return n, row[row != PAD].tolist()
        return 0, []


def _pack_one(gram: list[int], bits: int) -> int:
    key = 0
    for t in gram:
        key = (key << bits) | t
    return key


def _table(flat: np.ndarray, n: int, bits: int, length: int) -> tuple[np.ndarray, np.ndarray]:
    """The order-n table of `flat` (answers separated by `length` pads): sorted uint64 keys [M] and the most
    frequent continuation of each, int32 [M, length] padded with PAD. Equal continuations are grouped by a
    64-bit polynomial hash (two different ones would share a count with probability ~M^2 / 2^64; the draft is
    always a real continuation, so that only bends a tie), which keeps the sort to two keys."""
    pads = np.concatenate([[0], np.cumsum(flat == PAD)])  # pads[j] = pads before position j
    # an n-gram flat[j : j+n] of one answer with a successor: no pad among its n + 1 tokens
    starts = np.flatnonzero(pads[n + 1 :] - pads[: len(flat) - n] == 0)
    keys = np.zeros(len(starts), dtype=np.uint64)
    for j in range(n):
        keys = (keys << np.uint64(bits)) | flat[starts + j].astype(np.uint64)
    # a continuation window holds `length` tokens, so past its answer's end it reads pads, never the next
    # answer (`length` pads lie between them)
    digest = np.zeros(len(starts), dtype=np.uint64)
    with np.errstate(over="ignore"):  # the hash wraps around 2^64 on purpose
        for j in range(length):
            digest = digest * np.uint64(HASH_MULTIPLIER) + (flat[starts + n + j] + 2).astype(np.uint64)
    order = np.lexsort((digest, keys))  # by key, then continuation
    keys, digest, starts = keys[order], digest[order], starts[order]
    new = np.ones(len(keys), dtype=bool)
    new[1:] = (keys[1:] != keys[:-1]) | (digest[1:] != digest[:-1])
    first_of = np.flatnonzero(new)  # one run per (key, continuation)
    counts = np.diff(np.append(first_of, len(keys)))
    group_keys = keys[first_of]
    # per key the most frequent continuation; ties: the earliest in the answers
    pick = np.lexsort((starts[first_of], -counts, group_keys))
    first = np.ones(len(pick), dtype=bool)
    first[1:] = group_keys[pick[1:]] != group_keys[pick[:-1]]
    best = first_of[pick[first]]
    return keys[best], flat[starts[best, None] + n + np.arange(length)].astype(np.int32)


def token_folder(path: str | Path) -> Path:
    """A data-stage folder (its `tokens/` shards) or the shard folder itself."""
    path = Path(path)
    return path / "tokens" if (path / "tokens" / "manifest.json").exists() else path


def answers(folder: str | Path) -> list[np.ndarray]:
    """The target-written spans (loss_mask 1) of every row of a token-shard folder."""
    rows = TokenDataset(token_folder(folder))
    out = []
    for i in range(len(rows)):
        row = rows[i]
        ids, mask = row["input_ids"].numpy(), row["loss_mask"].numpy().astype(np.int8)
        edges = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))  # each span's start, then its end
        out += [ids[a:b] for a, b in zip(edges[::2], edges[1::2])]
    return out


def check_tokenizer(folder: str | Path, tokenizer_hash: str) -> None:
    """Refuse a datastore whose answers were tokenized by another tokenizer (its ids would mean other
    tokens): the data stage's manifest check, naming the manifest and the field."""
    folder = token_folder(folder)
    check(read_manifest(folder), {"tokenizer_hash": tokenizer_hash}, where=str(folder / "manifest.json"))


@functools.lru_cache(maxsize=4)
def load_datastore(folder: str, max_ngram: int, min_ngram: int, length: int) -> Datastore:
    """The datastore of a data folder's answers, built once per process and setting (a few seconds for a
    million tokens): every decoder of an evaluation shares it."""
    spans = answers(folder)
    store = Datastore.build(spans, max_ngram, min_ngram, length)
    sizes = ", ".join(f"{len(store.tables[n][0])} {n}-grams" for n in sorted(store.tables))
    log.info(f"lookup datastore: {len(spans)} answers, {store.tokens} tokens from {folder} ({sizes})")
    return store
