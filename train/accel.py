"""Where the trainer meets accelerate: mixed precision, the Accelerator, the DeepSpeed config, the frozen
teacher, and the casts DeepSpeed needs (it keeps bf16/fp16 weights and has no autocast)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, GradientAccumulationPlugin, InitProcessGroupKwargs

from specblock.data.target import auto_dtype

from .tracking import accelerate_log_with

if TYPE_CHECKING:
    from .trainer import TrainerConfig

MIXED_PRECISION = ("no", "bf16", "fp16", "auto")
LOW_PRECISION = {"bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_mixed_precision(mode: str) -> str:
    """ "auto": bf16 on a CUDA GPU that supports it; on a CPU, bf16 where its bf16 matrix products are
    measured faster than float32 ones (target.auto_dtype, data/hardware.py: on the AMD EPYC bf16 autocast ran the drafter
    step 1.4-2x faster, on an Intel Xeon with the same flags and no AMX 1.6x slower); else fp32."""
    if mode != "auto":
        return mode
    return "bf16" if auto_dtype("cuda" if torch.cuda.is_available() else "cpu") == "bfloat16" else "no"


def build_accelerator(cfg: TrainerConfig) -> Accelerator:
    # Launched on CPU: without gloo, DeepSpeed picks a backend that breaks its batch-size check.
    # (A plain single process must not get it: accelerate would then look for a process group.)
    launched_on_cpu = int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.cuda.is_available()
    handlers = [InitProcessGroupKwargs(backend="gloo")] if launched_on_cpu else []
    return Accelerator(
        mixed_precision=resolve_mixed_precision(cfg.mixed_precision),
        # Each optimizer step draws exactly grad_accum micro-batches, across epoch ends.
        gradient_accumulation_plugin=GradientAccumulationPlugin(
            num_steps=cfg.grad_accum, sync_with_dataloader=False
        ),
        step_scheduler_with_optimizer=False,  # one scheduler step per update, not one per rank
        rng_types=[],  # data order comes from EpochSampler; see module docstring
        log_with=accelerate_log_with(cfg.logger),
        kwargs_handlers=handlers,
    )


def sync_deepspeed_config(accelerator: Accelerator, cfg: TrainerConfig) -> None:
    """Make the DeepSpeed config agree with the trainer: fill "auto"/absent keys, refuse conflicts."""
    if accelerator.distributed_type != DistributedType.DEEPSPEED:
        return
    ds = accelerator.state.deepspeed_plugin.deepspeed_config
    wanted = {
        "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
        "gradient_accumulation_steps": cfg.grad_accum,
        "gradient_clipping": cfg.optim.grad_clip,
    }
    for key, value in wanted.items():
        if ds.get(key, "auto") not in ("auto", value):
            raise ValueError(f"DeepSpeed config has {key}={ds[key]} but the trainer config says {value}")
        ds[key] = value


def prepare_teacher(accelerator: Accelerator, teacher: torch.nn.Module | None) -> torch.nn.Module | None:
    """Frozen target for inference only: no grads, eval(), never given to the optimizer (habit 9).

    Outside DeepSpeed it is replicated on every rank's device. Under DeepSpeed it is wrapped like
    TRL's `prepare_deepspeed`: ZeRO-3 shards it with the drafter's (resolved) config, other stages
    use stage 0, so it gets the same bf16/fp16 dtype as the drafter. Call after `prepare()`.
    """
    if teacher is None:
        return None
    teacher.requires_grad_(False).eval()
    if accelerator.distributed_type != DistributedType.DEEPSPEED:
        return teacher.to(accelerator.device)
    import deepspeed

    ds = {k: v for k, v in accelerator.deepspeed_config.items() if k not in ("optimizer", "scheduler")}
    zero = dict(ds["zero_optimization"])
    ds["zero_optimization"] = zero if zero.get("stage") == 3 else {"stage": 0}
    engine, *_ = deepspeed.initialize(model=teacher, config=ds)
    engine.eval()
    return engine


def input_dtype(accelerator: Accelerator) -> torch.dtype | None:
    """DeepSpeed stores bf16/fp16 weights and has no autocast: float inputs must match them."""
    if accelerator.distributed_type != DistributedType.DEEPSPEED:
        return None
    return LOW_PRECISION.get(accelerator.mixed_precision)


def cast_floats(batch: Any, dtype: torch.dtype | None) -> Any:
    if dtype is None:
        return batch
    if isinstance(batch, torch.Tensor):
        return batch.to(dtype) if batch.is_floating_point() else batch
    if isinstance(batch, Mapping):
        return {k: cast_floats(v, dtype) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(cast_floats(v, dtype) for v in batch)
    return batch
