"""python -m specblock.data [hydra overrides]: prepare training data (see configs/prepare.yaml).

Under `accelerate launch` every process runs this; they split regeneration and feature capture by rank
(data/world.py) and write the outputs one process would.
"""

import hydra
from omegaconf import DictConfig, OmegaConf

from .errors import exit_on_user_error
from .logs import setup_logging

from .config import PrepareAppConfig, register_configs
from .prepare import prepare
from .world import launched_world, shutdown_distributed

register_configs()


@hydra.main(config_path="pkg://specblock.configs", config_name="prepare", version_base=None)
@exit_on_user_error
def main(cfg: DictConfig) -> None:
    setup_logging()
    config: PrepareAppConfig = OmegaConf.to_object(cfg)
    prepare(config.data, launched_world())
    shutdown_distributed()  # after success only: a failed rank exits with its error


if __name__ == "__main__":
    main()
