"""The target's next token (its argmax over the full vocabulary) at every token of an offline feature cache,
computed once through the frozen LM head and kept beside the shards.

Training reads the teacher's law over the draft vocabulary only, but whether the target's own next token lies
in the draft vocabulary (a slot's validity, train/batching.py) needs the argmax over all V logits: the full
head, 49k columns for SmolLM2 against 8k draft columns, on every batch of every epoch. This file holds that
argmax once: `<features>/target_argmax.safetensors`, one int32 tensor `argmax` [N_tok] over the cache's rows
in manifest order, with the sha256 of the manifest.json it was computed for and the head's key (`head_key`:
its dtype and a digest of its weights; a float32 run's argmax may differ from a bf16 run's at near-ties). A
cache captured again or another head makes it stale: it is computed again. Written atomically (temp name,
then rename).
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Callable, Sequence

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from .io import atomic_path, sha256_file
from .manifest import MANIFEST_NAME

log = logging.getLogger(__name__)

ARGMAX_FILE = "target_argmax.safetensors"
# Rows per head call: ~4k tokens x 49k logits in bf16 is ~0.4 GB at once.
_BATCH_TOKENS = 4096


def head_key(weight: torch.Tensor) -> str:
    """`dtype:sha256` of an LM head's weight [V, H]: what an argmax computed through it depends on."""
    w = weight.detach().contiguous().cpu()
    return f"{str(w.dtype).removeprefix('torch.')}:{hashlib.sha256(w.view(torch.uint8).numpy()).hexdigest()}"


def target_argmax(
    features_dir: str | Path,
    last_hidden: Sequence[torch.Tensor],
    head: Callable[[torch.Tensor], torch.Tensor],
    key: str,
) -> list[torch.Tensor]:
    """[T_r] int64 per row: the argmax of `head(last_hidden[r])` over its last dimension (the first maximal
    index, as `train.teacher_law.argmax_last`), read from the file beside the cache when it was made for
    this manifest, else computed row batch by row batch and written there. `last_hidden`: the cache's rows
    in manifest order ([T_r, H] each); `head`: hidden -> logits, the same function training applies; `key`:
    what the head is (`head_key`), stored with the argmax."""
    folder = Path(features_dir)
    path, manifest_sha = folder / ARGMAX_FILE, sha256_file(folder / MANIFEST_NAME)
    lengths = [len(h) for h in last_hidden]
    meta = {"manifest_sha256": manifest_sha, "head": key}
    flat = _read(path, meta, sum(lengths))
    if flat is None:
        flat = _compute(last_hidden, head, sum(lengths))
        with atomic_path(path) as tmp:
            save_file({"argmax": flat.to(torch.int32)}, str(tmp), metadata=meta)
        log.info(f"target argmax: {path} ({sum(lengths)} tokens)")
    return [t.long() for t in torch.split(flat, lengths)]


def _read(path: Path, meta: dict[str, str], tokens: int) -> torch.Tensor | None:
    """The stored argmax when the file exists, was made for this manifest and head (`meta`) and covers
    `tokens` tokens."""
    if not path.is_file():
        return None
    with safe_open(str(path), framework="pt") as f:
        stored = f.metadata() or {}
        flat = f.get_tensor("argmax") if all(stored.get(k) == v for k, v in meta.items()) else None
    if flat is None or flat.numel() != tokens:
        log.info(f"target argmax: {path} was made for another capture; computing it again")
        return None
    return flat


@torch.no_grad()
def _compute(
    last_hidden: Sequence[torch.Tensor], head: Callable[[torch.Tensor], torch.Tensor], tokens: int
) -> torch.Tensor:
    out, batch = [], []
    with tqdm(total=tokens, desc="target argmax", unit="tok", unit_scale=True) as bar:
        for i, h in enumerate(last_hidden):
            batch.append(h)
            if sum(len(b) for b in batch) >= _BATCH_TOKENS or i == len(last_hidden) - 1:
                n = sum(len(b) for b in batch)
                out.append(head(torch.cat(batch)).max(dim=-1).indices)
                bar.update(n)
                batch = []
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.long)
