"""The data stage under `accelerate launch`, killed on purpose: what `test_data_launch.py` launches.

`accelerate launch ... tests/data/data_worker.py CRASH_RANK CRASH_AT OVERRIDE...` composes the prepare
config from the Hydra overrides (as `python -m specblock.data OVERRIDE...` does) and runs the data stage on
every rank; rank CRASH_RANK dies in its CRASH_AT-th regeneration batch, as if killed.
"""

from __future__ import annotations

import sys

from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from specblock.data import regenerate as regen
from specblock.data.config import register_configs
from specblock.data.logs import setup_logging
from specblock.data.prepare import prepare
from specblock.data.world import launched_world


def main(crash_rank: int, crash_at: int, overrides: list[str]) -> None:
    setup_logging()
    register_configs()
    with initialize_config_module("specblock.configs", version_base=None):
        cfg = OmegaConf.to_object(compose("prepare", overrides=overrides)).data
    world = launched_world()
    if world.rank == crash_rank:
        real, calls = regen.generate_batch, []

        def dying(*args, **kwargs):
            calls.append(1)
            if len(calls) == crash_at:
                raise SystemExit(f"rank {world.rank}: killed in regeneration batch {crash_at}")
            return real(*args, **kwargs)

        regen.generate_batch = dying
    prepare(cfg, world)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:])
