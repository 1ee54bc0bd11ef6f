"""python -m specblock.data [hydra overrides]: prepare training data (see configs/prepare.yaml)."""

import hydra
from omegaconf import DictConfig, OmegaConf

from .errors import exit_on_user_error

from .config import PrepareAppConfig, register_configs
from .prepare import prepare

register_configs()


@hydra.main(config_path="pkg://specblock.configs", config_name="prepare", version_base=None)
@exit_on_user_error
def main(cfg: DictConfig) -> None:
    config: PrepareAppConfig = OmegaConf.to_object(cfg)
    prepare(config.data)


if __name__ == "__main__":
    main()
