"""The training stage end to end: data (skipped when up to date) -> drafter -> fit -> export."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from filelock import FileLock
from omegaconf import OmegaConf
from safetensors.torch import load_file
from torch.utils.data import Dataset, Subset
from transformers import PretrainedConfig

from specblock.data.capture import load_feature_rows
from specblock.data.manifest import read_manifest
from specblock.data.prepare import prepare
from specblock.data.repeats import CutRepeats, cut_row
from specblock.data.shards import TokenDataset
from specblock.data.target_argmax import head_key, target_argmax
from specblock.data.target import TargetHead, default_feature_layers, load_target

from .batching import collate
from .checkpoint import list_checkpoints, step_dir
from .config import TrainConfig
from .drafters import build_drafter, train_spec
from .export import export_checkpoint, export_config
from .modeling import build_vocab_map, count_tokens, start_from_target_layers
from .strategy import DrafterStrategy
from .tracking import is_main, log0, settle_wandb_mode, warn0
from .trainer import fit
from .validation import read_best, split_indices


def feature_rows(features_dir: Path, head: TargetHead | None = None) -> list[dict[str, torch.Tensor]]:
    """Every row of an offline feature cache (features, last_hidden, input_ids, loss_mask), in memory; with
    the target's `head`, also `target_argmax`, its full-vocabulary argmax per token (data/target_argmax.py:
    read from beside the cache, or computed once and kept there), so that a step's teacher needs the draft
    vocabulary's columns alone."""
    manifest = read_manifest(features_dir)
    rows = [row for shard in manifest.shards for row in load_feature_rows(features_dir / shard.file)]
    if head is not None:
        hidden = [r["last_hidden"] for r in rows]
        tops = target_argmax(features_dir, hidden, lambda h: head(h, upcast=False), head_key(head.weight))
        for row, top in zip(rows, tops):
            row["target_argmax"] = top
    return rows


def draft_vocab(rows, vocab_size: int, size: int | None) -> torch.Tensor | None:
    """d2t of the `size` most frequent assistant tokens of the training rows (None: full vocabulary)."""
    if size is None or size >= vocab_size:
        return None
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for r in rows:
        counts += count_tokens(torch.as_tensor(r["input_ids"]), vocab_size, torch.as_tensor(r["loss_mask"]))
    return build_vocab_map(counts, size)[0]


def read_init(
    folder: str | Path, drafter_cfg, layers: list[int], target_config: PretrainedConfig
) -> dict[str, torch.Tensor]:
    """The weights of an exported drafter to start a run from (`init_from`), checked against the run's
    drafter: the same architecture, drafter fields, target feature layers and target shape (vocabulary,
    hidden size), or one error naming the file and the fields that differ. Its d2t (the draft vocabulary)
    comes with it."""
    config = export_config(folder)
    ours = {"architecture": drafter_cfg.name, "feature_layers": list(layers)}
    ours.update({f"drafter.{k}": v for k, v in asdict(drafter_cfg).items()})
    ours.update(
        {f"target.{k}": getattr(target_config.get_text_config(), k) for k in ("vocab_size", "hidden_size")}
    )
    theirs = {"architecture": config.get("architecture"), "feature_layers": config.get("feature_layers")}
    saved_target = config.get("target", {}).get("config", {})
    theirs.update({f"target.{k}": saved_target.get(k) for k in ("vocab_size", "hidden_size")})
    theirs.update({f"drafter.{k}": v for k, v in config.get("drafter", {}).items()})
    differ = [f"{k} ({theirs.get(k)!r} there, {v!r} here)" for k, v in ours.items() if theirs.get(k) != v]
    if differ:
        raise ValueError(
            f"{Path(folder) / 'config.json'}: init_from does not fit this run's drafter: {'; '.join(differ)}"
        )
    return load_file(str(Path(folder) / "model.safetensors"))


@dataclass
class Built:
    """What a training run needs: the strategy, the training rows and the held-out ones (or None)."""

    strategy: DrafterStrategy
    rows: Dataset
    held_out: Dataset | None
    collate_fn: Callable
    target_config: PretrainedConfig


def build(cfg: TrainConfig) -> Built:
    """Data stage, target, dataset split, drafter and strategy for `cfg`."""
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out / ".prepare.lock")):  # every rank runs this; the first one does the work
        data = prepare(cfg.data)
    target, tokenizer = load_target(cfg.data.target)
    layers = cfg.data.target.feature_layers or default_feature_layers(target.config.num_hidden_layers)
    head = (
        TargetHead.of(target, copy=True) if cfg.features == "offline" else None
    )  # the offline teacher's head
    if head is not None:
        with FileLock(
            str(out / ".prepare.lock")
        ):  # the first rank computes the argmax file, the others read it
            rows = feature_rows(data.features_dir, head)
    else:
        rows = TokenDataset(data.tokens_dir)
    if cfg.cut_repeats:  # answers cut where they start to repeat (data/repeats.py)
        n = cfg.cut_repeats
        rows = [cut_row(r, n) for r in rows] if isinstance(rows, list) else CutRepeats(rows, n)
    val = cfg.validation
    train_idx, val_idx = split_indices(len(rows), val.fraction, val.max_rows, val.seed)
    rows, held_out = Subset(rows, train_idx), (Subset(rows, val_idx) if val_idx else None)
    drafter_cfg = replace(cfg.drafter, num_feature_layers=len(layers))
    init = read_init(cfg.init_from, drafter_cfg, layers, target.config) if cfg.init_from else None
    d2t = init["d2t"] if init else draft_vocab(rows, target.config.vocab_size, cfg.drafter.draft_vocab_size)
    torch.manual_seed(cfg.trainer.seed)  # the drafter's initial weights depend on the seed alone
    module = build_drafter(
        cfg.drafter.name,
        drafter_cfg,
        target.config,
        target.get_input_embeddings().weight,
        target.get_output_embeddings().weight,
        d2t,
    )
    if init is not None:
        module.load_state_dict(init, strict=True)
        log0(f"drafter initialised from {cfg.init_from}")
    if cfg.init_layers == "target":
        picked = start_from_target_layers(module, target.get_decoder().layers)
        log0(f"drafter decoder layers initialised from the target's layers {picked}")
    teacher = target if cfg.features == "online" else None
    strategy = train_spec(cfg.drafter.name).strategy(module, teacher, layers, cfg.loss, cfg.strategy, head)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return Built(strategy, rows, held_out, functools.partial(collate, pad_id=pad_id), target.config)


def train(cfg: TrainConfig, resolved: dict | None = None) -> dict[str, float]:
    """Runs the whole stage; returns the final metrics (of the last logging window)."""
    resolved = resolved if resolved is not None else asdict(cfg)
    earlier = list_checkpoints(cfg.trainer.output_dir)
    if earlier and cfg.trainer.resume is None:  # a fresh run would mix its checkpoints with another run's
        raise FileExistsError(
            f"{cfg.trainer.output_dir} already holds checkpoints ({earlier[-1].name}); continue "
            "with trainer.resume=latest, or pick another run_name / output_dir"
        )
    if (line := settle_wandb_mode(cfg.trainer.logger, Path(cfg.trainer.output_dir))) is not None:
        warn0(line)
    built = build(cfg)
    if is_main():
        OmegaConf.save(OmegaConf.create(resolved), Path(cfg.output_dir) / "config.yaml")
    lengths = [len(row["input_ids"]) for row in built.rows] if cfg.trainer.group_by_length else None
    metrics = fit(
        built.strategy,
        built.rows,
        built.collate_fn,
        cfg.trainer,
        run_config=resolved,
        eval_dataset=built.held_out,
        lengths=lengths,
    )
    log0("final metrics (last logging window):\n" + metrics_table(metrics))
    if cfg.export and is_main():
        # the final checkpoint, not strategy.module: under ZeRO-3 the module's parameters stay partitioned
        card = {
            "data": f"{cfg.data.corpus.source} ({cfg.data.out_dir}, regenerated={cfg.data.regenerate.enabled})",
            "steps": metrics.get("step"),
            "run": cfg.run_name,
            "metrics": metrics,
        }
        if cfg.init_from:
            card["init_from"] = cfg.init_from
        if cfg.init_layers != "random":
            card["init_layers"] = cfg.init_layers
        step = step_dir(cfg.trainer.output_dir, int(metrics["step"]))
        best = read_best(cfg.trainer.output_dir)
        if best is not None:  # the best validation step, as speculators keeps it
            step = Path(cfg.trainer.output_dir) / best["folder"]
            card.update(best={k: best[k] for k in ("step", "metric", "value")})
        path = export_checkpoint(cfg, step, Path(cfg.output_dir) / "drafter", built.target_config, card)
        log0(f"exported drafter: {path} (from {step.name})")
    return metrics


def metrics_table(metrics: dict[str, float]) -> str:
    """A Markdown table of the logged metrics, per-slot ones first."""
    rows = sorted(metrics.items(), key=lambda kv: ("top1" not in kv[0] and "accept" not in kv[0], kv[0]))
    return "\n".join(["| metric | value |", "|---|---|"] + [f"| {k} | {v:.4g} |" for k, v in rows])
