"""The training stage's typed config (Hydra ConfigStore schema; YAML under configs/ only overrides it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from specblock.data.config import PrepareConfig
from specblock.data.repeats import check_cut_repeats

from .distill import StrategyConfig
from .drafters import train_spec
from .losses import LossConfig
from .modeling import DrafterConfig
from .trainer import TrainerConfig

FEATURE_MODES = ("online", "offline")
# random: the drafter's decoder layers start from their own initialisation; target: as copies of the
# target's top layers (modeling.common.start_from_target_layers)
INIT_LAYERS = ("random", "target")


@dataclass
class ValidationConfig:
    """The held-out split of the training rows (seeded; `trainer.eval_every` says how often it is run):
    round(fraction * rows) rows, at most max_rows. fraction 0 = no validation."""

    fraction: float = 0.0
    max_rows: int | None = 256
    seed: int = 0

    def __post_init__(self):
        if not 0 <= self.fraction < 1 or (self.max_rows is not None and self.max_rows < 1):
            raise ValueError(f"validation needs 0 <= fraction < 1 and max_rows >= 1, got {self}")


@dataclass
class TrainConfig:
    """`python -m specblock.train`: data stage (skipped when up to date) -> distillation -> export."""

    run_name: str = "debug"
    output_dir: str = "checkpoints/debug"
    features: str = "online"  # online: target forward in the step; offline: the data stage's feature cache
    export: bool = True  # write <output_dir>/drafter at the end
    resume: str | None = None  # shorthand for trainer.resume: `resume=latest` or a step folder
    # an exported drafter folder (<run>/drafter) to start from instead of random weights: fine-tuning on
    # new data keeps its draft vocabulary; a resumed run reads its own checkpoint instead
    init_from: str | None = None
    init_layers: str = "random"  # INIT_LAYERS: how a run without init_from starts its decoder layers
    # n > 0: every row (training and held-out) is cut where its answer first repeats an n-token span it
    # already holds (data/repeats.py: a small target's greedy answers fall into loops); 0 keeps rows whole
    cut_repeats: int = 0
    data: PrepareConfig = field(default_factory=PrepareConfig)
    # the `drafter` group: configs/drafter/<name>.yaml over its drafter's own schema (drafters.py)
    drafter: DrafterConfig = MISSING
    loss: LossConfig = field(default_factory=LossConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    trainer: TrainerConfig = field(
        default_factory=lambda: TrainerConfig(output_dir="checkpoints/debug", max_steps=10)
    )

    def __post_init__(self):
        if not isinstance(self.drafter, DrafterConfig):
            raise ValueError(
                f"drafter is not set: choose a drafter config (drafter=<name>), got {self.drafter!r}"
            )
        spec = train_spec(self.drafter.name)
        if not isinstance(self.drafter, spec.config):
            raise TypeError(
                f"drafter {spec.name!r} takes a {spec.config.__name__}, got {type(self.drafter).__name__}"
            )
        if self.resume is not None:
            self.trainer.resume = self.resume
        if self.trainer.eval_every > 0 and self.validation.fraction == 0:
            raise ValueError("trainer.eval_every > 0 needs a held-out split: set validation.fraction > 0")
        if self.init_layers not in INIT_LAYERS:
            raise ValueError(f"init_layers={self.init_layers!r} is not one of {INIT_LAYERS}")
        check_cut_repeats(self.cut_repeats, "cut_repeats")
        if self.init_layers != "random" and self.init_from:
            raise ValueError(
                f"init_from={self.init_from!r} sets every weight of the drafter; init_layers="
                f"{self.init_layers!r} would set its decoder layers too: choose one"
            )
        if self.features not in FEATURE_MODES:
            raise ValueError(f"features={self.features!r} is not one of {FEATURE_MODES}")
        if self.features == "offline" and not self.data.features.enabled:
            raise ValueError("features=offline needs the data stage's cache: set data.features.enabled=true")


def register_configs() -> None:
    """base_train; every registered drafter's schema (base_<name>, group drafter) is stored when it is
    registered (drafters.py)."""
    cs = ConfigStore.instance()
    cs.store(name="base_train", node=TrainConfig)


def saved_run_config(run_dir: str | Path) -> DictConfig:
    """A run's saved config.yaml read into today's schema (its drafter's included): keys the schema no
    longer has are dropped, keys it gained take their defaults. Runs saved before each drafter had a
    schema of its own hold every drafter's fields under `drafter` (the other drafters' meant nothing to
    the run) and the rank classes under `loss.rank_buckets` too (a check kept them equal to the drafter's);
    the cpu_full runs of session 5 are such runs."""
    saved = OmegaConf.load(Path(run_dir) / "config.yaml")
    schema = OmegaConf.structured(TrainConfig)
    schema.drafter = OmegaConf.structured(train_spec(saved.drafter.name).config)
    return OmegaConf.merge(schema, _known(saved, schema))


def _known(saved: DictConfig, schema: DictConfig) -> dict:
    """The keys of `saved` that `schema` has, recursively into typed nodes (dict-typed fields whole)."""
    out = {}
    for key, value in saved.items():
        if key not in schema:
            continue
        node = schema[key]
        known = (
            isinstance(value, DictConfig)
            and isinstance(node, DictConfig)
            and OmegaConf.get_type(node) is not dict
        )
        out[key] = _known(value, node) if known else value
    return out
