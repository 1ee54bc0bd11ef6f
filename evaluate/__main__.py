"""python -m specblock.evaluate [overrides]: the evaluation stage (see evaluate/config.py for every field).

Sweeps: python -m specblock.evaluate --multirun draft_length=2,4,6 temperature=0,0.7 ... then
`specblock eval-report checkpoints/eval/multirun` pools the jobs' results and plots them."""

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from specblock.data.errors import exit_on_user_error
from specblock.data.logs import setup_logging

from .config import EvalConfig, register_configs
from .run import evaluate

register_configs()


@hydra.main(config_path="pkg://specblock.configs", config_name="eval", version_base=None)
@exit_on_user_error
def main(cfg: DictConfig) -> None:
    setup_logging()
    hc = HydraConfig.get()
    if hc.mode == RunMode.MULTIRUN:  # one folder per sweep job, not one shared output_dir
        cfg.output_dir = hc.runtime.output_dir
    config: EvalConfig = OmegaConf.to_object(cfg)
    evaluate(config, OmegaConf.to_container(cfg, resolve=True))


if __name__ == "__main__":
    main()
