"""Resumable training checkpoints and the drafter weights inside them.

Layout: `<output_dir>/step_XXXXXX/` holds everything `accelerator.save_state` writes (model,
optimizer, scheduler, per-rank RNG states, and the registered objects: the `TrainProgress` that
positions the data stream, and the strategy's extra state) plus `meta.json` (step, epoch, tokens,
config hash, how to read the weights). A checkpoint is complete iff its folder has that name and a
`meta.json`: it is written as `.tmp_step_XXXXXX/` and renamed by rank 0 after every rank finished,
so a crash mid-save leaves only a `.tmp_` folder that `find_latest` ignores and the next save
replaces. `output_dir` must be on a filesystem every rank sees (DeepSpeed writes one shard per rank).

The data position is ours too: `EpochSampler` draws one seeded permutation per epoch and can
start part-way through it; `micro_batch_stream` runs across epoch ends and keeps `TrainProgress`
current, so a resumed run draws exactly the micro-batches an uninterrupted run would have drawn.

Training checkpoints are for resuming; `train/export.py` turns weights into a self-describing drafter
from `read_model_state` (offline, from a step folder; ZeRO shards merged).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from torch.utils.data import Sampler

META = "meta.json"
STEP_FORMAT = "step_{:06d}"
STEP_RE = re.compile(r"^step_(\d{6,})$")
TMP_PREFIX = ".tmp_"
DS_TAG = "pytorch_model"  # the DeepSpeed checkpoint tag accelerate uses for the first model
SAFETENSORS_WEIGHTS = "model.safetensors"  # what accelerate writes for the first model otherwise


class EpochSampler(Sampler[int]):
    """One seeded permutation of range(n) per epoch, optionally starting at position `start`.

    Length grouping (`lengths` [n] and `group` > 0): the permutation is cut into chunks of `group`
    micro-batches of `batch` samples; each chunk is sorted by length and its micro-batches are shuffled,
    so a micro-batch holds rows of similar length (less padding: the SpecBlock step's attention grows
    with (T*K)^2) while the order stays random at the scale of micro-batches. The order is a function of
    (seed, epoch) alone, so resuming at `start` replays it exactly.

    Not a RandomSampler on purpose: accelerate leaves it alone (no seed synchronisation, no
    replacement by its own sampler); its `set_epoch` is called by the prepared DataLoader.
    """

    def __init__(self, n: int, seed: int, lengths=None, group: int = 0, batch: int = 1):
        if lengths is not None and len(lengths) != n:
            raise ValueError(f"{len(lengths)} lengths for {n} samples")
        self.n, self.seed, self.epoch, self.start = n, seed, 0, 0
        self.lengths = None if lengths is None or group <= 0 else torch.as_tensor(lengths)
        self.group, self.batch = group, batch

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n - self.start

    def __iter__(self) -> Iterator[int]:
        rng = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(self.n, generator=rng)
        if self.lengths is not None:
            order = self._grouped(order, rng)
        yield from order[self.start :].tolist()

    def _grouped(self, order: torch.Tensor, rng: torch.Generator) -> torch.Tensor:
        chunk, out = self.group * self.batch, []
        for lo in range(0, self.n, chunk):
            part = order[lo : lo + chunk]
            part = part[torch.argsort(self.lengths[part], stable=True, descending=True)]
            whole = len(part) // self.batch * self.batch  # a ragged tail stays last, in length order
            batches = part[:whole].view(-1, self.batch)[torch.randperm(whole // self.batch, generator=rng)]
            out += [batches.flatten(), part[whole:]]
        return torch.cat(out)


@dataclass
class TrainProgress:
    """Where training stands; identical on every rank, saved with each checkpoint.

    step: optimizer updates done. epoch: epoch of the next micro-batch. batch_in_epoch: micro-batches
    of that epoch each rank already consumed. tokens: tokens seen, summed over ranks. train_ms: wall
    milliseconds spent in optimizer steps over every session of the run (for curves against compute).
    """

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    tokens: int = 0
    train_ms: int = 0

    def state_dict(self) -> dict[str, int]:
        return asdict(self)

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        for key, value in state.items():  # older checkpoints lack newer fields: they keep their default
            setattr(self, key, int(value))


def micro_batch_stream(loader, sampler: EpochSampler, progress: TrainProgress, unit: int) -> Iterator[Any]:
    """Endless micro-batches across epochs, resuming at `progress`; `unit` = samples per micro-batch
    over all ranks (micro_batch_size x world), so skipping k per-rank batches skips k x unit samples."""
    while True:
        sampler.start = progress.batch_in_epoch * unit
        loader.set_epoch(progress.epoch)
        for batch in loader:
            progress.batch_in_epoch += 1
            yield batch
        progress.epoch, progress.batch_in_epoch = progress.epoch + 1, 0


def step_dir(output_dir: str | os.PathLike, step: int) -> Path:
    return Path(output_dir) / STEP_FORMAT.format(step)


def list_checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoints under `output_dir`, oldest first."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if STEP_RE.match(p.name) and (p / META).is_file()]
    return sorted(found, key=lambda p: int(STEP_RE.match(p.name).group(1)))


def find_latest(output_dir: str | os.PathLike) -> Path | None:
    """The complete checkpoint with the highest step, or None."""
    found = list_checkpoints(output_dir)
    return found[-1] if found else None


def resolve_resume(resume: str | None, output_dir: str | os.PathLike) -> Path | None:
    """`None` -> None; `"latest"` -> `find_latest(output_dir)` (None: nothing to resume yet);
    otherwise the given step folder, which must be a complete checkpoint."""
    if resume is None:
        return None
    if resume == "latest":
        return find_latest(output_dir)
    path = Path(resume)
    if not (path / META).is_file():
        raise FileNotFoundError(f"resume={resume!r} is not a complete checkpoint (no {path / META})")
    return path


def config_hash(config: Mapping[str, Any]) -> str:
    """A short, stable digest of a (nested, JSON-able) config."""
    blob = json.dumps(config, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    return json.loads((Path(path) / META).read_text())


def _weights_meta(accelerator: Accelerator, model: torch.nn.Module, folder: Path) -> dict[str, str]:
    """How `read_model_state` finds the drafter weights in this checkpoint (rank 0, after saving)."""
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        return {"format": "deepspeed", "tag": DS_TAG}
    from safetensors import safe_open

    with safe_open(str(folder / SAFETENSORS_WEIGHTS), framework="pt") as f:
        stored = list(f.keys())
    inner = set(accelerator.unwrap_model(model).state_dict())
    prefix = _key_prefix(stored, inner, folder)
    return {"format": "safetensors", "file": SAFETENSORS_WEIGHTS, "key_prefix": prefix}


def _key_prefix(stored: list[str], inner: set[str], folder: Path) -> str:
    """The prefix a wrapper put before the unwrapped module's keys in the saved file ("" if none;
    e.g. "module." for DDP or "_orig_mod." for torch.compile, depending on the accelerate version).
    Read from the file rather than assumed; safetensors may have dropped tied duplicates."""
    first = stored[0]
    for name in sorted(inner, key=len, reverse=True):
        prefix = first[: len(first) - len(name)]
        if first.endswith(name) and all(k.startswith(prefix) and k[len(prefix) :] in inner for k in stored):
            return prefix
    raise RuntimeError(f"the weights saved in {folder} do not match the drafter's parameter names")


def save_checkpoint(
    accelerator: Accelerator,
    model: torch.nn.Module,
    output_dir: str | os.PathLike,
    progress: TrainProgress,
    cfg_hash: str,
    keep_last: int,
    keep: set[int] = frozenset(),
    keep_every: int = 0,
) -> Path:
    """Write `step_XXXXXX/` atomically, then keep only the newest `keep_last` (0: keep all), the steps
    in `keep` (the best validation step) and the multiples of `keep_every` (milestones).

    Collective: every rank must call it.
    """
    final = step_dir(output_dir, progress.step)
    tmp = final.with_name(TMP_PREFIX + final.name)
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a crashed save
        tmp.parent.mkdir(parents=True, exist_ok=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        meta = {
            **progress.state_dict(),
            "config_hash": cfg_hash,
            "num_processes": accelerator.num_processes,
            "weights": _weights_meta(accelerator, model, tmp),
        }
        (tmp / META).write_text(json.dumps(meta, indent=2) + "\n")
        if final.exists():  # an earlier attempt at this step, e.g. before resuming from an older one
            shutil.rmtree(final)
        os.replace(tmp, final)
        prune_checkpoints(output_dir, keep_last, keep, keep_every)
    accelerator.wait_for_everyone()
    return final


def prune_checkpoints(
    output_dir: str | os.PathLike, keep_last: int, keep: set[int] = frozenset(), keep_every: int = 0
) -> None:
    """Delete all but the newest `keep_last` complete checkpoints (0: keep all), the steps in `keep` and
    the multiples of `keep_every` (0: none)."""
    if keep_last <= 0:
        return
    for old in list_checkpoints(output_dir)[:-keep_last]:
        step = int(STEP_RE.match(old.name).group(1))
        if step not in keep and not (keep_every and step % keep_every == 0):
            shutil.rmtree(old)


def load_checkpoint(accelerator: Accelerator, path: str | os.PathLike) -> dict[str, Any]:
    """Restore everything `save_checkpoint` wrote (all ranks); returns its meta.json."""
    accelerator.load_state(str(path))
    return read_meta(path)


def read_model_state(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The unwrapped drafter state dict stored in a step folder, without an accelerator (CPU).

    DeepSpeed checkpoints (ZeRO-2/3 shards) are merged into fp32 with DeepSpeed's zero_to_fp32.
    """
    path = Path(path)
    weights = read_meta(path)["weights"]
    if weights["format"] == "deepspeed":
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        return get_fp32_state_dict_from_zero_checkpoint(str(path), tag=weights["tag"])
    from safetensors.torch import load_file

    prefix = weights["key_prefix"]
    state = load_file(str(path / weights["file"]))
    return {key[len(prefix) :]: value for key, value in state.items()}
