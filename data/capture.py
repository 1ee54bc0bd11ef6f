"""Offline target features: run the frozen target once over tokenized rows and store, per token, the chosen
hidden states and the final hidden state as safetensors shards + manifest.json. Logits are not stored
(V is large): `FeatureTarget.logits_from_hidden(last_hidden)` recomputes them through the frozen LM head.

Shard layout (rows packed end to end, no padding; row r is tokens offsets[r]:offsets[r+1]):
  features    [N_tok, L*H]  bf16/fp16   hidden_states[feature_layers] concatenated (low|mid|high)
  last_hidden [N_tok, H]    bf16/fp16   after the final norm, what the LM head reads
  input_ids   [N_tok] int32, loss_mask [N_tok] uint8, offsets [rows+1] int64, row_index [rows] int64
Shard s holds the valid rows s*shard_rows ... (s+1)*shard_rows-1. Each shard is written atomically and
carries a fingerprint of its settings and inputs, so a re-run skips finished shards (resume) and refuses
shards made from something else. manifest.json is written last: its presence means the capture is complete.

Several ranks (`world`, data/world.py): shard s is captured by rank s % size, each rank resuming from its
own finished shards; once all are done rank 0 checks the others' shards and writes the one manifest,
listing every shard in row order. A shard's bytes depend on its rows and settings alone, so the folder
equals a single process's.

Size cap policy: with `max_gb` set, a capture whose projected size exceeds it is REFUSED before anything is
written (the message says how many rows would fit); cap it explicitly with `max_rows`. Nothing is silently
truncated.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from .errors import BadInputError, RowPolicy
from .io import atomic_path, sha256_file
from .manifest import (
    IDENTITY_FIELDS,
    MANIFEST_NAME,
    Manifest,
    ManifestMismatchError,
    ShardInfo,
    chat_template_hash,
    check,
    code_git_sha,
    read_manifest,
    tokenizer_hash,
    write_manifest,
)
from .repeats import check_cut_repeats, cut_at_repeat
from .target import FeatureTarget
from .world import World

log = logging.getLogger(__name__)

FEATURE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
# 128 rows x 2k tokens x 4 states x 576 x 2 B is ~1.2 GB for SmolLM2: big enough that shard overhead is
# nil, small enough to hold in memory while it is filled and to lose little work on a crash.
DEFAULT_SHARD_ROWS = 128
GB = 1e9
# Per token, besides the hidden states: int32 input id + uint8 loss mask.
_TOKEN_OVERHEAD_BYTES = 5
_TENSORS = ("features", "last_hidden", "input_ids", "loss_mask", "offsets", "row_index")


@dataclass
class CaptureConfig:
    """How to capture: stored dtype, truncation, rows per forward and per shard, and caps."""

    dtype: str = "bfloat16"
    max_length: int = 2048
    batch_size: int = 8
    shard_rows: int = DEFAULT_SHARD_ROWS
    max_gb: float | None = None
    max_rows: int | None = None
    on_bad_row: str = "error"
    # > 0: each row is cut where its answer first repeats a cut_repeats-token span (data/repeats.py) before
    # capture, so that max_rows (and max_gb) count the tokens training keeps; 0: whole rows
    cut_repeats: int = 0

    def __post_init__(self):
        if self.dtype not in FEATURE_DTYPES:
            raise ValueError(f"capture.dtype={self.dtype!r} is not one of {sorted(FEATURE_DTYPES)}")
        if min(self.max_length, self.batch_size, self.shard_rows) < 1:
            raise ValueError(f"capture needs max_length, batch_size and shard_rows >= 1, got {self}")
        if self.max_gb is not None and self.max_gb <= 0:
            raise ValueError(f"capture.max_gb must be positive, got {self.max_gb}")
        if self.max_rows is not None and self.max_rows < 1:
            raise ValueError(f"capture.max_rows must be >= 1, got {self.max_rows}")
        check_cut_repeats(self.cut_repeats, "capture.cut_repeats")
        RowPolicy(self.on_bad_row)  # validates the value


@dataclass
class CapturePlan:
    """The valid rows (indices into the input) and their token counts after truncation."""

    indices: list[int] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)  # after truncation and the cut (cfg.cut_repeats)
    truncated: int = 0
    cut: int = 0  # rows cut where their answer starts to repeat

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)


class CaptureTooLargeError(ValueError):
    """The projected capture exceeds max_gb."""


def bytes_per_token(num_layers: int, hidden_size: int, dtype: str) -> int:
    """Stored bytes per token: (feature layers + final hidden) x H x dtype size, plus id and mask."""
    return (num_layers + 1) * hidden_size * FEATURE_DTYPES[dtype].itemsize + _TOKEN_OVERHEAD_BYTES


def _validate_row(row: Any, index: int, source: str, vocab_size: int) -> int:
    """Returns the row's length; raises BadInputError naming source, row and field if it is malformed."""
    if not isinstance(row, Mapping):
        raise BadInputError(
            source, index, None, f"expected a dict with input_ids and loss_mask, got {type(row).__name__}"
        )
    for name in ("input_ids", "loss_mask"):
        value = row.get(name)
        if value is None:
            raise BadInputError(source, index, name, "missing")
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            raise BadInputError(source, index, name, "expected a list of ints")
    ids, mask = row["input_ids"], row["loss_mask"]
    if not ids:
        raise BadInputError(source, index, "input_ids", "empty")
    if len(mask) != len(ids):
        raise BadInputError(source, index, "loss_mask", f"length {len(mask)} != len(input_ids) {len(ids)}")
    if any(v not in (0, 1) for v in mask):
        raise BadInputError(source, index, "loss_mask", "values must be 0 or 1")
    if min(ids) < 0 or max(ids) >= vocab_size:
        raise BadInputError(
            source, index, "input_ids", f"token id outside the target vocabulary [0, {vocab_size})"
        )
    return len(ids)


def plan_capture(rows: Sequence[Mapping], cfg: CaptureConfig, vocab_size: int, source: str) -> CapturePlan:
    """Validates every row (bad ones raise or are skipped and counted, per cfg.on_bad_row), truncates to
    cfg.max_length, cuts where the answer first repeats (cfg.cut_repeats > 0) and stops after cfg.max_rows
    valid rows."""
    policy, plan = RowPolicy(cfg.on_bad_row), CapturePlan()
    for index in tqdm(range(len(rows)), desc="check rows", unit="row", leave=False):
        if cfg.max_rows is not None and len(plan.indices) == cfg.max_rows:
            break
        row = rows[index]  # once: a datasets.Dataset decodes on every access
        try:
            length = _validate_row(row, index, source, vocab_size)
        except BadInputError as err:
            policy.bad(err)
            continue
        keep = min(length, cfg.max_length)
        plan.truncated += length > cfg.max_length
        if cfg.cut_repeats:
            cut = cut_at_repeat(row["input_ids"][:keep], row["loss_mask"][:keep], cfg.cut_repeats)
            plan.cut += cut < keep
            keep = cut
        plan.indices.append(index)
        plan.lengths.append(keep)
    if policy.total_skipped:
        log.info(f"capture: {policy.summary()}")
    return plan


def check_size(plan: CapturePlan, target: FeatureTarget, cfg: CaptureConfig) -> int:
    """Prints the projected size and returns it in bytes; refuses (CaptureTooLargeError) above cfg.max_gb."""
    per_token = bytes_per_token(len(target.feature_layers), target.hidden_size, cfg.dtype)
    total = plan.num_tokens * per_token
    itemsize, layers = FEATURE_DTYPES[cfg.dtype].itemsize, len(target.feature_layers)
    log.info(
        f"capture: {len(plan.indices)} rows, {plan.num_tokens} tokens x ({layers} layers + final) x "
        f"{target.hidden_size} x {itemsize} B = {total / GB:.3f} GB ({plan.truncated} rows truncated to "
        f"{cfg.max_length} tokens"
        + (
            f", {plan.cut} cut where their answer repeats a {cfg.cut_repeats}-token span)"
            if cfg.cut_repeats
            else ")"
        )
    )
    if cfg.max_gb is not None and total > cfg.max_gb * GB:
        fit = sum(1 for tokens in itertools.accumulate(plan.lengths) if tokens * per_token <= cfg.max_gb * GB)
        raise CaptureTooLargeError(
            f"capture would write {total / GB:.3f} GB > max_gb={cfg.max_gb}; nothing "
            f"written. Raise max_gb, or set max_rows={fit} to capture the rows "
            "that fit."
        )
    return total


Rows = dict[int, tuple[list[int], list[int]]]  # input index -> (input_ids, loss_mask), truncated and cut
ShardPlan = tuple[Path, Rows, str]  # (shard file, its rows, fingerprint of settings + rows)


def _load_rows(rows: Sequence[Mapping], indices: list[int], lengths: list[int]) -> Rows:
    """Reads one shard's rows once (a datasets.Dataset decodes on every access), each cut to its planned
    length (`plan_capture`)."""
    return {
        i: (list(rows[i]["input_ids"][:n]), list(rows[i]["loss_mask"][:n])) for i, n in zip(indices, lengths)
    }


def _fingerprint(identity: Mapping[str, Any], shard: Rows) -> str:
    """sha256 of the capture settings and the (truncated) inputs of one shard."""
    h = hashlib.sha256(json.dumps(identity, sort_keys=True).encode())
    for i, (ids, mask) in shard.items():
        h.update(json.dumps([i, ids, mask]).encode())
    return h.hexdigest()


def _capture_shard(
    target: FeatureTarget, shard: Rows, cfg: CaptureConfig, bar: tqdm
) -> dict[str, torch.Tensor]:
    """Runs the target over one shard's rows in length-sorted batches (less padding), packs real tokens."""
    dtype = FEATURE_DTYPES[cfg.dtype]
    per_row: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    order = sorted(shard, key=lambda i: len(shard[i][0]))
    for start in range(0, len(order), cfg.batch_size):
        batch = order[start : start + cfg.batch_size]
        seqs = [torch.tensor(shard[i][0]) for i in batch]
        input_ids = torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True)  # [B,T], right-padded with 0
        mask = torch.nn.utils.rnn.pad_sequence([torch.ones_like(s) for s in seqs], batch_first=True)
        out = target(input_ids, mask, with_logits=False)
        for b, i in enumerate(batch):
            n = len(seqs[b])
            per_row[i] = (out.features[b, :n].to("cpu", dtype), out.last_hidden[b, :n].to("cpu", dtype))
        bar.update(sum(len(s) for s in seqs))
    lengths = torch.tensor([len(ids) for ids, _ in shard.values()])
    return {
        "features": torch.cat([per_row[i][0] for i in shard]),
        "last_hidden": torch.cat([per_row[i][1] for i in shard]),
        "input_ids": torch.tensor([t for ids, _ in shard.values() for t in ids], dtype=torch.int32),
        "loss_mask": torch.tensor([m for _, mask in shard.values() for m in mask], dtype=torch.uint8),
        "offsets": torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]),
        "row_index": torch.tensor(list(shard), dtype=torch.int64),
    }


def capture_features(
    target: FeatureTarget,
    rows: Sequence[Mapping],
    out_dir: str | Path,
    cfg: CaptureConfig | None = None,
    *,
    tokenizer: Any,
    source: str = "rows",
    tokens_manifest: Manifest | None = None,
    world: World = World(),
) -> Path:
    """Captures features for `rows` (dicts with int lists input_ids and loss_mask; `source` names them in
    errors) into `out_dir`, resuming from finished shards; returns out_dir (see the module docstring).
    With `tokens_manifest` (the rows' own manifest), rows from another tokenizer or template are refused.
    Every rank calls it with the same rows; it returns on every rank once the manifest is written."""
    cfg, out_dir = cfg or CaptureConfig(), Path(out_dir)
    expected = Manifest(
        kind="features",
        target_id=target.target_id,
        target_revision=target.revision,
        tokenizer_hash=tokenizer_hash(tokenizer),
        chat_template_hash=chat_template_hash(tokenizer),
        layer_ids=list(target.feature_layers),
        dtype=cfg.dtype,
        max_length=cfg.max_length,
        hidden_size=target.hidden_size,
        cut_repeats=cfg.cut_repeats,
    )
    if tokens_manifest is not None:
        check(
            tokens_manifest,
            {
                "kind": "tokens",
                "tokenizer_hash": expected.tokenizer_hash,
                "chat_template_hash": expected.chat_template_hash,
            },
            where=f"{source} manifest",
        )
        expected.extra["tokens_manifest"] = {
            "created": tokens_manifest.created,
            "num_samples": tokens_manifest.num_samples,
        }
    plan = plan_capture(rows, cfg, target.vocab_size, source)
    if not plan.indices:
        raise BadInputError(source, None, None, "no valid rows to capture")
    identity = {name: getattr(expected, name) for name in (*IDENTITY_FIELDS, "hidden_size")}
    if cfg.cut_repeats:  # only then: the shards of whole rows keep the fingerprints they were written with
        identity["cut_repeats"] = cfg.cut_repeats
    if (out_dir / MANIFEST_NAME).is_file():
        return _already_complete(out_dir, expected, rows, plan, cfg, identity)
    check_size(plan, target, cfg)
    shard_plan = functools.partial(_shard_plan, rows, plan, cfg, out_dir, identity)
    shard_tokens = [
        sum(plan.lengths[s : s + cfg.shard_rows]) for s in range(0, len(plan.lengths), cfg.shard_rows)
    ]
    my_tokens = sum(n for s, n in enumerate(shard_tokens) if world.owns(s))
    expected.shards = _write_shards(target, shard_plan, cfg, my_tokens, world)
    if world.is_main:
        expected.num_samples, expected.num_tokens = len(plan.indices), plan.num_tokens
        expected.code_git_sha = code_git_sha()
        expected.extra.update(source=source, row_layout="packed", tensors=list(_TENSORS))
        write_manifest(out_dir, expected)
    world.barrier()  # the manifest exists for every rank that returns
    return out_dir


def _shard_name(index: int) -> str:
    return f"features-{index:05d}.safetensors"


def _shard_plan(
    rows: Sequence[Mapping], plan: CapturePlan, cfg: CaptureConfig, out_dir: Path, identity: dict[str, Any]
) -> Iterator[ShardPlan]:
    """Yields (shard path, its rows, its fingerprint) in order; shard s holds valid rows s*shard_rows...."""
    for s in range(0, len(plan.indices), cfg.shard_rows):
        path = out_dir / _shard_name(s // cfg.shard_rows)
        part = slice(s, s + cfg.shard_rows)
        shard = _load_rows(rows, plan.indices[part], plan.lengths[part])
        yield path, shard, _fingerprint({**identity, "shard": path.name}, shard)


def _write_shards(
    target: FeatureTarget,
    shard_plan: Callable[[], Iterator[ShardPlan]],
    cfg: CaptureConfig,
    my_tokens: int,
    world: World,
) -> list[ShardInfo]:
    """Writes this rank's shards (shard s is rank s % world.size's), or keeps one already there from the
    same inputs. Once every rank is done, returns all shards in order with their sha256 on rank 0, after
    checking the other ranks' shards against their fingerprints; [] on the other ranks."""
    shards: dict[int, ShardInfo] = {}
    with tqdm(total=my_tokens, desc="capture", unit="tok", unit_scale=True) as bar:
        for s, (path, shard, fingerprint) in enumerate(shard_plan()):
            if not world.owns(s):
                continue
            if path.is_file():
                _check_fingerprint(path, fingerprint)
                bar.update(sum(len(ids) for ids, _ in shard.values()))
            else:
                tensors = _capture_shard(target, shard, cfg, bar)
                with atomic_path(path) as tmp:
                    save_file(tensors, str(tmp), metadata={"fingerprint": fingerprint})
            shards[s] = ShardInfo(file=path.name, rows=len(shard), sha256=sha256_file(path))
    world.barrier()  # every rank's shards are written
    if not world.is_main:
        return []
    if world.size > 1:
        for s, (path, shard, fingerprint) in enumerate(shard_plan()):
            if s not in shards:
                _check_fingerprint(path, fingerprint)
                shards[s] = ShardInfo(file=path.name, rows=len(shard), sha256=sha256_file(path))
    return [shards[s] for s in sorted(shards)]


def _check_fingerprint(path: Path, fingerprint: str) -> None:
    if not path.is_file():
        raise BadInputError(str(path), None, None, "this shard is missing (did a rank stop early?)")
    with safe_open(str(path), framework="pt") as f:
        found = (f.metadata() or {}).get("fingerprint")
    if found != fingerprint:
        raise BadInputError(
            str(path),
            None,
            "fingerprint",
            "this shard was captured from other rows or "
            f"settings; delete {path.parent} or use another out_dir",
        )


def _already_complete(
    out_dir: Path,
    expected: Manifest,
    rows: Sequence[Mapping],
    plan: CapturePlan,
    cfg: CaptureConfig,
    identity: dict[str, Any],
) -> Path:
    """A finished capture: refuse one made differently (settings and counts via the manifest, rows via the
    shard fingerprints, without re-hashing whole files); otherwise there is nothing to do."""
    found, where = read_manifest(out_dir), str(out_dir / MANIFEST_NAME)
    wanted = {name: getattr(expected, name) for name in (*IDENTITY_FIELDS, "cut_repeats")}
    check(found, {**wanted, "num_samples": len(plan.indices), "num_tokens": plan.num_tokens}, where=where)
    planned = [_shard_name(s) for s in range(math.ceil(len(plan.indices) / cfg.shard_rows))]
    if [shard.file for shard in found.shards] != planned:
        raise ManifestMismatchError(
            f"{where} lists {len(found.shards)} shards, this run expects "
            f"{len(planned)} (another shard_rows?); delete {out_dir} or use "
            "another out_dir"
        )
    for path, _, fingerprint in _shard_plan(rows, plan, cfg, out_dir, identity):
        _check_fingerprint(path, fingerprint)
    log.info(f"capture: {out_dir} is already complete ({found.num_samples} rows)")
    return out_dir


def load_feature_rows(path: str | Path) -> list[dict[str, torch.Tensor]]:
    """Unpacks one shard into per-row dicts: features [T,L*H], last_hidden [T,H], input_ids [T] int64,
    loss_mask [T] bool, row_index (int). For tests and inspection: a training dataset should read the
    shards lazily (safetensors safe_open + get_slice on the offsets)."""
    with safe_open(str(path), framework="pt") as f:
        t = {name: f.get_tensor(name) for name in _TENSORS}
    rows = []
    for r, (a, b) in enumerate(zip(t["offsets"][:-1].tolist(), t["offsets"][1:].tolist())):
        rows.append(
            {
                "features": t["features"][a:b],
                "last_hidden": t["last_hidden"][a:b],
                "input_ids": t["input_ids"][a:b].long(),
                "loss_mask": t["loss_mask"][a:b].bool(),
                "row_index": int(t["row_index"][r]),
            }
        )
    return rows
