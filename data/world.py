"""Where this process stands among the processes `accelerate launch` started for the data stage.

The data stage splits its work by rank: regeneration by batch of conversations, feature capture by shard
(`owns`); rank 0 merges the parts once every rank is done (`barrier`). A plain `python -m specblock.data`
is rank 0 of 1 and does everything itself, exactly as before the scale-out.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable

# How long a rank waits at a barrier for the others. Shares are equal in rows, not in time: a rank whose
# share was mostly done by an earlier, killed run waits for the others' whole remainder (hours on a big
# corpus), far beyond torch.distributed's 30-minute default.
BARRIER_TIMEOUT = timedelta(days=2)


def _no_barrier() -> None:
    """A single process has nobody to wait for."""


@dataclass(frozen=True)
class World:
    """rank / size: this process's global rank and the number of processes (all machines together);
    local_rank: its index on this machine (which GPU it drives); barrier: returns once every rank called it.
    """

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    barrier: Callable[[], None] = field(default=_no_barrier, compare=False, repr=False)

    def __post_init__(self):
        if not 0 <= self.rank < self.size or self.local_rank < 0:
            raise ValueError(f"world needs 0 <= rank < size and local_rank >= 0, got {self}")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def owns(self, unit: int) -> bool:
        """True when work unit `unit` (a batch of conversations, a feature shard) is this rank's: units
        are dealt round-robin, so every rank gets an equal share of a long list and units keep the
        boundaries a single process gives them (same batches, same seeds, same shard files)."""
        return unit % self.size == self.rank

    def device(self, configured: str) -> str:
        """The device this rank runs the target on: a bare `cuda` means this rank's own GPU
        (cuda:<local_rank>) when there are several processes; anything else is taken as configured."""
        return f"cuda:{self.local_rank}" if configured == "cuda" and self.size > 1 else configured


def launched_world() -> World:
    """This process's World: from accelerate's PartialState under `accelerate launch` (which sets
    WORLD_SIZE for every rank, as torchrun does), rank 0 of 1 otherwise. A single process never creates a
    process group, so a plain run has no distributed side effects."""
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched <= 1:
        return World()
    from accelerate import PartialState
    from accelerate.utils import parse_flag_from_env

    # `accelerate launch --cpu` (or use_cpu in its config) says so through this variable, which
    # Accelerator reads but PartialState does not. The timeout bounds every collective, barriers included.
    state = PartialState(cpu=parse_flag_from_env("ACCELERATE_USE_CPU"), timeout=BARRIER_TIMEOUT)
    if state.num_processes != launched:  # else every process would write the same files as "rank 0 of 1"
        raise ValueError(
            f"{launched} processes were launched but accelerate set up {state.num_processes} "
            f"({state.distributed_type}): without GPUs, launch with --cpu or ACCELERATE_USE_CPU=true"
        )
    return World(
        rank=state.process_index,
        size=state.num_processes,
        local_rank=state.local_process_index,
        barrier=state.wait_for_everyone,
    )


def shutdown_distributed() -> None:
    """End this rank's process group, if `accelerate launch` made one, before the interpreter exits: a
    rank that exits with the group alive can abort in its teardown (gloo: "terminate called without an
    active exception", exit code -6 after a finished run, seen under load) and fail the launch. A no-op
    in a single process."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()  # no rank tears down the group while another still uses it
        dist.destroy_process_group()
