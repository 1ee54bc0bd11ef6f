"""The data stage's typed config (Hydra ConfigStore schema; YAML under configs/ only overrides it)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from .capture import CaptureConfig
from .corpora import CorpusConfig
from .regenerate import RegenerateConfig
from .target import TargetConfig

# the token shards' folder under the data stage's out_dir (FeaturesConfig.subdir names the feature cache's)
TOKENS_SUBDIR = "tokens"
# local copies of public datasets: the corpora's `local_or_hub` and the evaluation's local_root=auto
DATASETS_ENV = "SPECBLOCK_DATASETS"


def local_or_hub(relative: str, hub_id: str) -> str:
    """The YAML resolver `${local_or_hub:gsm8k/train.jsonl,openai/gsm8k}`: $SPECBLOCK_DATASETS/<relative>
    when that variable is set (offline machines; a missing file is then named by the corpus loader), else
    the hub id (with the corpus config's split and subset)."""
    root = os.environ.get(DATASETS_ENV)
    return str(Path(root).expanduser() / relative) if root else hub_id


if not OmegaConf.has_resolver("local_or_hub"):
    OmegaConf.register_new_resolver("local_or_hub", local_or_hub)


@dataclass
class FeaturesConfig(CaptureConfig):
    """Offline target features: off by default (training computes them online, in the step).

    subdir: the cache's folder under the data stage's out_dir. Recipes that share a data folder but capture
    differently (the quick recipe's first 840 rows, cpu_full's every row) each need their own: a finished
    cache whose manifest differs from the config is refused, not overwritten."""

    enabled: bool = False
    subdir: str = "features"

    def __post_init__(self):
        super().__post_init__()
        if (
            not self.subdir
            or Path(self.subdir).name != self.subdir
            or self.subdir in (".", "..", TOKENS_SUBDIR)
        ):
            raise ValueError(
                f"features.subdir must be one folder name other than {TOKENS_SUBDIR!r}, got {self.subdir!r}"
            )


@dataclass
class PrepareConfig:
    """`python -m specblock.data`: corpus -> (regenerated) conversations -> token shards (+ features)."""

    run_name: str = "sharegpt-regen"
    out_dir: str = "checkpoints/data/sharegpt-regen"  # regenerated.jsonl, tokens/, features/
    max_length: int = 1024  # tokens per training row (template included); longer rows are cut
    shard_rows: int = 1000
    overwrite: bool = False  # rebuild token shards whose manifest does not match this config
    target: TargetConfig = field(default_factory=TargetConfig)
    # on_bad_row=skip: the packaged ShareGPT file ends in a cut row and holds empty conversations
    corpus: CorpusConfig = field(default_factory=lambda: CorpusConfig(limit=32, on_bad_row="skip"))
    # more corpora, each drawn by its own config and spread evenly among corpus's conversations (in order;
    # data/corpora.py load_mixture), e.g. the questions of an evaluated domain's train split
    mix: list[CorpusConfig] = field(default_factory=list)
    regenerate: RegenerateConfig = field(default_factory=RegenerateConfig)
    features: FeaturesConfig = field(default_factory=FeaturesConfig)

    def __post_init__(self):
        if self.max_length < 8 or self.shard_rows < 1:
            raise ValueError(
                f"prepare needs max_length >= 8 and shard_rows >= 1, got {self.max_length}, {self.shard_rows}"
            )


@dataclass
class PrepareAppConfig:
    """The root of `python -m specblock.data`: the data config sits under `data`, as in the training app,
    so an override reads the same in both (`data.corpus.limit=500`)."""

    data: PrepareConfig = field(default_factory=PrepareConfig)


def register_configs() -> None:
    cs = ConfigStore.instance()
    cs.store(name="base_prepare", node=PrepareAppConfig)
