"""The training stage's typed config (Hydra ConfigStore schema; YAML under configs/ only overrides it)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from hydra.core.config_store import ConfigStore

from specblock.data.config import PrepareConfig

from .distill import StrategyConfig
from .losses import LossConfig
from .modeling import DRAFTER_CONFIGS
from .trainer import TrainerConfig

FEATURE_MODES = ("online", "offline")


@dataclass
class DrafterConfig:
    """Which drafter (a DRAFTERS name) and its architecture: the union of the drafters' fields; each
    drafter reads its own (`specific()`). draft_vocab_size None = the target's full vocabulary."""

    name: str = "specblock"
    block_size: int = 4  # SpecBlock: slots per block (K)
    num_layers: int = 2  # SpecBlock: decoder layers
    ttt_length: int = 7  # EAGLE-3: training-time-test steps
    draft_vocab_size: int | None = None
    rank_buckets: list[int] = field(default_factory=lambda: [1, 4, 10])
    rank_hidden: int = 256
    rank_topk: int = 10

    def __post_init__(self):
        if self.name not in DRAFTER_CONFIGS:
            raise ValueError(f"drafter.name={self.name!r} is not one of {sorted(DRAFTER_CONFIGS)}")

    def specific(self, num_feature_layers: int):
        """The registered drafter's own config dataclass, built from the fields it has."""
        cls = DRAFTER_CONFIGS[self.name]
        names = {f.name for f in fields(cls)}
        values = {k: v for k, v in vars(self).items() if k in names}
        return cls(**values, num_feature_layers=num_feature_layers)


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
    data: PrepareConfig = field(default_factory=PrepareConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    trainer: TrainerConfig = field(
        default_factory=lambda: TrainerConfig(output_dir="checkpoints/debug", max_steps=10)
    )

    def __post_init__(self):
        if self.resume is not None:
            self.trainer.resume = self.resume
        if self.trainer.eval_every > 0 and self.validation.fraction == 0:
            raise ValueError("trainer.eval_every > 0 needs a held-out split: set validation.fraction > 0")
        if self.features not in FEATURE_MODES:
            raise ValueError(f"features={self.features!r} is not one of {FEATURE_MODES}")
        if self.features == "offline" and not self.data.features.enabled:
            raise ValueError("features=offline needs the data stage's cache: set data.features.enabled=true")
        if self.drafter.name == "specblock" and list(self.loss.rank_buckets) != list(
            self.drafter.rank_buckets
        ):
            raise ValueError(
                f"loss.rank_buckets {list(self.loss.rank_buckets)} must equal drafter.rank_buckets "
                f"{self.drafter.rank_buckets}: the rank head predicts those classes"
            )


def register_configs() -> None:
    cs = ConfigStore.instance()
    cs.store(name="base_train", node=TrainConfig)
