"""python -m specblock.train [experiment=debug|quick|gpu_8b] [overrides]; under accelerate launch too."""

import hydra
from omegaconf import DictConfig, OmegaConf

from specblock.data.errors import exit_on_user_error
from specblock.data.logs import setup_logging
from specblock.data.world import shutdown_distributed

from .config import TrainConfig, register_configs
from .run import train

register_configs()


@hydra.main(config_path="pkg://specblock.configs", config_name="train", version_base=None)
@exit_on_user_error
def main(cfg: DictConfig) -> None:
    setup_logging()
    config: TrainConfig = OmegaConf.to_object(cfg)
    train(config, OmegaConf.to_container(cfg, resolve=True))
    shutdown_distributed()  # after success only: a failed rank exits with its error


if __name__ == "__main__":
    main()
