"""Tokenized training rows as safetensors shards with a manifest, and the dataset that reads them.

A shard holds R rows flattened: `input_ids` int32 [N], `loss_mask` uint8 [N] and `offsets` int64 [R+1]
(row r is [offsets[r], offsets[r+1])). The whole folder is written under a temporary name and renamed
when complete, so a folder with a manifest.json is always whole.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Mapping, Sequence

import torch
from safetensors.torch import load_file, save_file

from .io import atomic_path, sha256_file
from .manifest import Manifest, ShardInfo, check, read_manifest, verify_shards, write_manifest

SHARD_NAME = "tokens-{:05d}.safetensors"


def write_token_shards(
    rows: Sequence[Mapping], out_dir: str | Path, manifest: Manifest, shard_rows: int = 1000
) -> Manifest:
    """rows: dicts with `input_ids` and `loss_mask` int sequences of equal length. Returns the manifest
    written (counts and checksums filled in from `manifest`, kind 'tokens')."""
    out_dir = Path(out_dir)
    shards, tokens = [], 0
    with atomic_path(out_dir) as tmp:
        tmp.mkdir()
        for s, start in enumerate(range(0, len(rows), shard_rows)):
            chunk = rows[start : start + shard_rows]
            name = SHARD_NAME.format(s)
            save_file(pack(chunk), str(tmp / name))
            shards.append(ShardInfo(name, len(chunk), sha256_file(tmp / name)))
            tokens += sum(len(r["input_ids"]) for r in chunk)
        manifest = replace(
            manifest, kind="tokens", dtype="int32", num_samples=len(rows), num_tokens=tokens, shards=shards
        )
        write_manifest(tmp, manifest)
    return manifest


def pack(rows: Sequence[Mapping]) -> dict[str, torch.Tensor]:
    lengths = [len(r["input_ids"]) for r in rows]
    if any(len(r["loss_mask"]) != n for r, n in zip(rows, lengths)):
        raise ValueError("every row needs input_ids and loss_mask of the same length")
    offsets = torch.zeros(len(rows) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)
    flat = lambda key, dtype: torch.tensor([t for r in rows for t in r[key]], dtype=dtype)  # noqa: E731
    return {
        "input_ids": flat("input_ids", torch.int32),
        "loss_mask": flat("loss_mask", torch.uint8),
        "offsets": offsets,
    }


class TokenDataset(torch.utils.data.Dataset):
    """Rows of a token-shard folder: {"input_ids": int64 [T], "loss_mask": int64 [T]}.

    expected: manifest fields the caller requires (target, tokenizer, template, max_length); a folder made
    for another target is refused with a message naming every field that differs. verify: re-hash shards.
    """

    def __init__(self, folder: str | Path, expected: Manifest | Mapping | None = None, verify: bool = False):
        self.folder = Path(folder)
        self.manifest = read_manifest(self.folder)
        if self.manifest.kind != "tokens":
            raise ValueError(f"{self.folder}: a '{self.manifest.kind}' folder, expected token shards")
        if expected is not None:
            check(self.manifest, expected, where=str(self.folder / "manifest.json"))
        if verify:
            verify_shards(self.manifest, self.folder)
        self._index = [(s, r) for s, info in enumerate(self.manifest.shards) for r in range(info.rows)]
        self._cache: tuple[int, dict[str, torch.Tensor]] | None = None

    def __len__(self) -> int:
        return len(self._index)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        s, r = self._index[i]
        if self._cache is None or self._cache[0] != s:
            self._cache = (s, load_file(str(self.folder / self.manifest.shards[s].file)))
        t = self._cache[1]
        lo, hi = int(t["offsets"][r]), int(t["offsets"][r + 1])
        return {"input_ids": t["input_ids"][lo:hi].long(), "loss_mask": t["loss_mask"][lo:hi].long()}
