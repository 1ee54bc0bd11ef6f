"""The one training loop: `fit(strategy, dataset, collate_fn, cfg)`, for every drafter type.

The loop knows nothing about drafters (habit 4): a `DrafterStrategy` turns a micro-batch into loss
numerators, their counts and metric sums (see `strategy.py` for the normalisation contract). It runs
the same way in one process, under DDP and under DeepSpeed ZeRO-2/3 (`accelerate launch --config_file
configs/accelerate/<name>.yaml`).

Data order is ours, not accelerate's (`checkpoint.EpochSampler`, `checkpoint.micro_batch_stream`):
resuming replays exactly the micro-batches an uninterrupted run would see, and nothing at iterator
creation consumes the global RNG, so a resumed run matches an uninterrupted one bit for bit.

Each optimizer step draws `grad_accum` micro-batches up front, gets the loss counts of the later ones
(`strategy.loss_counts`, no gradients), runs the first, adds its counts, all-reduces them over the
ranks, and back-propagates `strategy.loss(sums_i, global counts) * grad_accum * world` for every
micro-batch i through `accelerator.backward`, which divides by `grad_accum` and whose gradient
reduction averages over ranks: the gradient is that of the effective batch's loss. (accelerate's
documented recipe for loss normalisation over the number of items under gradient accumulation,
with counts that may depend on the forward.)
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, Dataset
from tqdm.auto import tqdm

from .accel import (
    MIXED_PRECISION,
    build_accelerator,
    cast_floats,
    input_dtype,
    prepare_teacher,
    sync_deepspeed_config,
)
from .checkpoint import (
    EpochSampler,
    TrainProgress,
    config_hash,
    load_checkpoint,
    micro_batch_stream,
    resolve_resume,
    save_checkpoint,
)
from .metric_window import TOKENS, MetricWindow, peak_memory_gib
from .optim import OptimConfig, build_optimizer, build_scheduler
from .ratios import Sums
from .strategy import DrafterStrategy
from .tracking import TRACKERS, NullTracker, headline, log0, make_tracker
from .validation import Validator, write_best

_clock = time.perf_counter  # what the steps are timed with (a test's fake clock replaces it)


@dataclass
class TrainerConfig:
    output_dir: str
    max_steps: int | None = None  # optimizer steps; exactly one of max_steps / epochs
    epochs: float | None = None
    # A wall-clock budget (Lightning's max_time): the run stops, saves and exports after the first step at
    # which its optimizer steps have taken this many minutes over every session of the run
    # (`TrainProgress.train_ms`: validation, saves and the data stage not counted); 0: no budget. The LR
    # schedule and the curriculum still follow max_steps / epochs (size them from the projection it logs).
    max_minutes: float = 0.0
    micro_batch_size: int = 8  # per rank
    grad_accum: int = 1
    seed: int = 0
    mixed_precision: str = (
        "auto"  # "auto": bf16 where bf16 matrix products are faster (resolve_mixed_precision)
    )
    save_every: int = 500  # steps; 0: only at the end
    keep_last: int = 3  # complete checkpoints kept; 0: all
    keep_every: int = 0  # checkpoints at multiples of this step are kept too (milestones); 0: none
    log_every: int = 10
    logger: str = "none"  # one of tracking.TRACKERS
    project: str = "specblock"
    run_name: str = "run"
    resume: str | None = None  # None, "latest" or a step folder
    num_workers: int = 0
    # Length grouping (checkpoint.EpochSampler): micro-batches per sorted chunk; 0: plain shuffling.
    group_by_length: int = 0
    # Validation on the held-out split (train.validation): every eval_every steps and at the end (0: off).
    eval_every: int = 0
    best_metric: str = "accept_len"  # a strategy metric (logged as val/<name>) that picks the best step
    best_mode: str = "max"  # "max" or "min"
    optim: OptimConfig = field(default_factory=OptimConfig)

    def __post_init__(self) -> None:
        if (self.max_steps is None) == (self.epochs is None):
            raise ValueError("set exactly one of max_steps and epochs")
        if (self.max_steps or 1) <= 0 or (self.epochs or 1) <= 0:
            raise ValueError(f"max_steps / epochs must be positive: {self.max_steps} / {self.epochs}")
        if min(self.micro_batch_size, self.grad_accum, self.log_every) < 1:
            raise ValueError("micro_batch_size, grad_accum and log_every must be >= 1")
        if min(self.save_every, self.keep_last, self.keep_every, self.num_workers, self.group_by_length) < 0:
            raise ValueError(
                "save_every, keep_last, keep_every, num_workers and group_by_length must be >= 0"
            )
        if not self.max_minutes >= 0:
            raise ValueError(f"max_minutes must be >= 0 (0: no budget), got {self.max_minutes}")
        if self.eval_every < 0 or self.best_mode not in ("max", "min"):
            raise ValueError(
                f"eval_every must be >= 0 and best_mode max|min, got {self.eval_every}, {self.best_mode}"
            )
        if self.mixed_precision not in MIXED_PRECISION:
            raise ValueError(f"mixed_precision={self.mixed_precision!r}; expected one of {MIXED_PRECISION}")
        if self.logger not in TRACKERS:
            raise ValueError(f"logger={self.logger!r}; expected one of {TRACKERS}")

    def check_milestones(self) -> None:
        """Refuse milestones that are never saved (checked when a run starts, not when a saved run's
        config is read back: runs saved before this check still load)."""
        if self.keep_every and (not self.save_every or self.keep_every % self.save_every):
            raise ValueError(
                f"keep_every={self.keep_every} must be a multiple of save_every={self.save_every} "
                "(milestones are kept from the checkpoints saved every save_every steps)"
            )


@dataclass
class _Run:
    """Everything the loop touches, prepared."""

    accelerator: Accelerator
    cfg: TrainerConfig
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    stream: Iterator[Any]
    progress: TrainProgress
    total_steps: int
    batches_per_rank: int  # micro-batches per epoch on each rank
    cfg_hash: str
    input_dtype: torch.dtype | None


def _total_steps(cfg: TrainerConfig, batches_per_rank: int) -> int:
    if cfg.max_steps is not None:
        return cfg.max_steps
    return max(1, math.ceil(cfg.epochs * batches_per_rank / cfg.grad_accum))


def _prepare(
    strategy: DrafterStrategy,
    dataset: Dataset,
    collate_fn: Callable,
    cfg: TrainerConfig,
    run_config: Mapping[str, Any],
    lengths: Sequence[int] | None = None,
) -> _Run:
    accelerator = build_accelerator(cfg)
    set_seed(cfg.seed)
    sampler = EpochSampler(len(dataset), cfg.seed, lengths, cfg.group_by_length, cfg.micro_batch_size)
    loader = DataLoader(
        dataset,
        batch_size=cfg.micro_batch_size,
        sampler=sampler,
        drop_last=True,
        collate_fn=collate_fn,
        num_workers=cfg.num_workers,
        generator=torch.Generator().manual_seed(cfg.seed),
    )  # keeps the global RNG untouched
    unit = cfg.micro_batch_size * accelerator.num_processes
    batches_per_rank = len(dataset) // unit
    if batches_per_rank == 0:
        raise ValueError(
            f"{len(dataset)} samples give no full micro-batch of {cfg.micro_batch_size} "
            f"on each of {accelerator.num_processes} ranks"
        )
    total = _total_steps(cfg, batches_per_rank)
    sync_deepspeed_config(accelerator, cfg)
    optimizer = build_optimizer(strategy.module, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim, total)
    model, optimizer, loader, scheduler = accelerator.prepare(strategy.module, optimizer, loader, scheduler)
    strategy.module = model
    strategy.teacher = prepare_teacher(accelerator, getattr(strategy, "teacher", None))
    progress = TrainProgress()
    accelerator.register_for_checkpointing(progress, strategy)
    stream = micro_batch_stream(loader, sampler, progress, unit)
    return _Run(
        accelerator,
        cfg,
        model,
        optimizer,
        scheduler,
        stream,
        progress,
        total,
        batches_per_rank,
        config_hash(dict(run_config)),
        input_dtype(accelerator),
    )


def _maybe_resume(run: _Run) -> None:
    path = resolve_resume(run.cfg.resume, run.cfg.output_dir)
    if path is None:
        if run.cfg.resume is not None:
            log0(f"resume={run.cfg.resume!r}: no checkpoint under {run.cfg.output_dir}, starting fresh")
        return
    meta = load_checkpoint(run.accelerator, path)
    if meta.get("config_hash") != run.cfg_hash:
        log0(f"resuming from {path} whose config hash {meta.get('config_hash')} differs from {run.cfg_hash}")
    log0(f"resumed from {path} at step {run.progress.step}, epoch {run.progress.epoch}")


def _draw(run: _Run) -> list[tuple[Any, int]]:
    """The micro-batches of one optimizer step, each with its epoch (the stream crosses epoch ends)."""
    drawn = []
    for _ in range(run.cfg.grad_accum):
        batch = cast_floats(next(run.stream), run.input_dtype)
        drawn.append((batch, run.progress.epoch))
    return drawn


def _counts_ahead(run: _Run, strategy: DrafterStrategy, micro: list[tuple[Any, int]]) -> list[dict]:
    """The loss counts of a step's micro-batches after the first, without gradients. In a fork of the
    RNG, so that a strategy drawing random numbers in its forward (dropout) trains on the same stream
    whatever `grad_accum` is."""
    if len(micro) < 2:
        return []
    acc, step = run.accelerator, run.progress.step
    devices = [acc.device] if acc.device.type == "cuda" else []
    with torch.no_grad(), torch.random.fork_rng(devices=devices), acc.autocast():
        return [strategy.loss_counts(batch, step, epoch) for batch, epoch in micro[1:]]


def _step_counts(
    acc: Accelerator, first: Mapping[str, Any], ahead: list[Mapping[str, Any]], tokens: float
) -> dict[str, torch.Tensor]:
    """The loss counts of every micro-batch of the step (the first's, then `_counts_ahead`'s) and its
    sequence tokens, added over the micro-batches and the ranks (one collective)."""
    if TOKENS in first:
        raise ValueError(f"strategy loss counts may not use the name {TOKENS!r}: the trainer's")
    total = Sums(acc.device).update({**first, TOKENS: tokens})
    for part in ahead:
        total.update(part)
    return total.reduce(acc)


def _train_step(run: _Run, strategy: DrafterStrategy, window: MetricWindow) -> None:
    """One optimizer update over `grad_accum` micro-batches (the loss contract: `strategy.py`)."""
    acc, progress, start = run.accelerator, run.progress, _clock()
    micro = _draw(run)
    ahead = _counts_ahead(run, strategy, micro)
    tokens = sum(float(strategy.num_tokens(b)) for b, _ in micro)
    scale = acc.gradient_accumulation_steps * acc.num_processes  # undo backward's / GA and DDP's mean
    counts = None
    for batch, epoch in micro:
        with acc.accumulate(run.model):
            with acc.autocast():
                out = strategy.forward_loss(batch, progress.step, epoch)
            if counts is None:  # the first micro-batch: now every count of the step is known
                counts = _step_counts(acc, out.counts, ahead, tokens)
                n_tokens = float(counts.pop(TOKENS))
            loss = strategy.loss(out.sums, counts)
            acc.backward(loss * scale)
        window.add_output(out, loss.detach())
    if not acc.sync_gradients:
        raise RuntimeError("gradient accumulation is out of step with the trainer's micro-batch count")
    grad_norm = acc.clip_grad_norm_(run.model.parameters(), run.cfg.optim.grad_clip or math.inf)
    lr = run.scheduler.get_last_lr()[0]
    run.optimizer.step()
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    window.add_step(n_tokens, float(grad_norm) if grad_norm is not None else math.nan, lr)
    progress.step += 1
    progress.tokens += int(n_tokens)
    progress.train_ms += round(1000 * (_clock() - start))


def _budget_spent(run: _Run) -> bool:
    """Whether `cfg.max_minutes` of optimizer steps are spent; the same answer on every rank (each
    times its own steps: the slowest rank decides, so no rank stops while another waits in a collective)."""
    if not run.cfg.max_minutes:
        return False
    spent = torch.tensor([float(run.progress.train_ms)], device=run.accelerator.device)
    return float(run.accelerator.reduce(spent, reduction="max")) >= run.cfg.max_minutes * 60_000


def _budget_line(run: _Run) -> str:
    """Where the wall-clock budget stands and how many steps it allows at the run's mean step time."""
    used, step = run.progress.train_ms / 60_000, run.progress.step
    line = f"budget: {used:.1f} of {run.cfg.max_minutes:g} min"
    if step:
        fit = min(
            run.total_steps, step + int((run.cfg.max_minutes - used) * 60_000 * step / run.progress.train_ms)
        )
        line += f", {run.progress.train_ms / 1000 / step:.2f} s a step: ~{fit} of {run.total_steps} steps fit"
    return line


def _log_metrics(run: _Run, window: MetricWindow) -> dict[str, float]:
    stats = window.reduce(run.accelerator)
    epoch = run.progress.epoch + run.progress.batch_in_epoch / run.batches_per_rank
    stats.update(
        epoch=epoch,
        tokens_seen=float(run.progress.tokens),
        peak_mem_gib=peak_memory_gib(run.accelerator.device),
    )  # this rank's peak
    return {f"train/{k}": v for k, v in stats.items()}


def _loop(run: _Run, strategy: DrafterStrategy, tracker, validation: Validator | None) -> dict[str, float]:
    """Steps until `total_steps` (or `cfg.max_minutes`), logging every `log_every`, validating every
    `eval_every` and saving every `save_every`, at a new best validation result and at the end."""
    cfg, metrics = run.cfg, {}
    if _budget_spent(run):
        log0(
            f"trainer.max_minutes={cfg.max_minutes:g} is spent at step {run.progress.step} ({_budget_line(run)}): "
            "no step trained; raise trainer.max_minutes to continue"
        )
        return metrics
    window = MetricWindow(run.accelerator.device)
    bar = tqdm(
        total=run.total_steps,
        initial=run.progress.step,
        desc="train",
        disable=not run.accelerator.is_main_process,
    )
    with bar:
        while run.progress.step < run.total_steps:
            strategy.module.train()
            _train_step(run, strategy, window)
            step, last = run.progress.step, run.progress.step == run.total_steps
            if not last and _budget_spent(run):
                log0(
                    f"step {step}: trainer.max_minutes={cfg.max_minutes:g} reached ({_budget_line(run)}); "
                    "stopping here (the checkpoint of this step is saved and exported)"
                )
                last = True
            bar.update()
            if step % cfg.log_every == 0 or last:
                metrics = _log_metrics(run, window)
                tracker.log(metrics, step=step)
                bar.set_postfix(loss=f"{metrics['train/loss']:.4f}")
                log0(
                    f"step {step}: loss {metrics['train/loss']:.4f}, lr {metrics['train/lr']:.2e}, "
                    f"{metrics['train/tokens_per_s']:.0f} tok/s, {headline(metrics, 'train/')}"
                    + (f"; {_budget_line(run)}" if cfg.max_minutes else "")
                )  # the console and the job's log file (every metric goes to the tracker)
                window = MetricWindow(run.accelerator.device)
            best = False
            if validation is not None and (step % cfg.eval_every == 0 or last):
                best = validation.run(run.accelerator, strategy, tracker, step)
                metrics.update(validation.last)
            if (cfg.save_every and step % cfg.save_every == 0) or last or best:
                keep = {validation.best.step} if validation is not None else set()
                folder = save_checkpoint(
                    run.accelerator,
                    run.model,
                    cfg.output_dir,
                    run.progress,
                    run.cfg_hash,
                    cfg.keep_last,
                    keep,
                    cfg.keep_every,
                )
                if best and run.accelerator.is_main_process:
                    write_best(cfg.output_dir, validation.best, cfg.best_metric, folder)
            if last:
                break
    return metrics


def fit(
    strategy: DrafterStrategy,
    train_dataset: Dataset,
    collate_fn: Callable,
    cfg: TrainerConfig,
    run_config: Mapping[str, Any] | None = None,
    eval_dataset: Dataset | None = None,
    lengths: Sequence[int] | None = None,
) -> dict[str, float]:
    """Train `strategy.module` for `cfg.max_steps` (or `cfg.epochs`) optimizer steps.

    `run_config` (default: `asdict(cfg)`) is what the tracker records and the checkpoint hash covers;
    pass the whole resolved run config (secret-looking keys are redacted before logging). With
    `eval_dataset` and `cfg.eval_every` > 0 the run validates on it (train.validation) and keeps its best
    step. `lengths` (tokens per training row) enables `cfg.group_by_length`. Returns the metrics of the
    last logging window (and validation) plus `step`. After return `strategy.module` is the unwrapped
    drafter again (under ZeRO-3 its parameters stay partitioned: read the final checkpoint with
    `checkpoint.read_model_state`) and `strategy.teacher` the original teacher.
    """
    cfg.check_milestones()
    run_config = run_config if run_config is not None else asdict(cfg)
    teacher = getattr(strategy, "teacher", None)
    if cfg.group_by_length and lengths is None:
        raise ValueError("trainer.group_by_length needs the rows' lengths")
    run = _prepare(strategy, train_dataset, collate_fn, cfg, run_config, lengths)
    validation = None
    if eval_dataset is not None and cfg.eval_every > 0:
        validation = Validator(
            eval_dataset,
            lambda rows: cast_floats(collate_fn(rows), run.input_dtype),
            cfg.micro_batch_size,
            cfg.best_metric,
            cfg.best_mode,
            lambda: MetricWindow(run.accelerator.device),
        )
        run.accelerator.register_for_checkpointing(validation.best)
    log0(
        f"training on {run.accelerator.num_processes} process(es), {run.accelerator.distributed_type.value}, "
        f"mixed precision {run.accelerator.mixed_precision}"
        + (" (auto: measured, data/hardware.py)" if cfg.mixed_precision == "auto" else "")
    )
    tracker = NullTracker()
    try:
        _maybe_resume(run)
        tracker = make_tracker(
            cfg.logger,
            run.accelerator,
            project=cfg.project,
            run_name=cfg.run_name,
            config=run_config,
            log_dir=Path(cfg.output_dir),
        )
        metrics = _loop(run, strategy, tracker, validation)
    finally:
        tracker.finish()
        strategy.module = run.accelerator.unwrap_model(run.model)
        strategy.teacher = teacher
    return {**metrics, "step": run.progress.step}
