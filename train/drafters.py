"""One spec per drafter, registered once: what the training stage needs to know about a drafter type.

Anchor: torchtitan's `TrainSpec` / `register_train_spec`. A drafter is registered by name with

    register_drafter(TrainSpec(name, config, module, strategy, serving_export=None))

- `config`: its typed config, a `modeling.common.DrafterConfig` subclass whose `name` defaults to the
  spec's name. Registering stores it in Hydra's ConfigStore as `base_<name>` in the `drafter` group,
  the schema `configs/drafter/<name>.yaml` extends (`defaults: [base_<name>, _self_]`), so a key the
  drafter does not have is refused when the config is composed;
- `module`: builds the nn.Module from (config, target config, embedding [V,H], LM head [V,H], d2t),
  usually the module class itself (what a drafter module offers: modeling/common.py's docstring);
- `strategy`: its `DrafterStrategy` (distill.py), built as strategy(module, teacher, feature layers,
  loss config, strategy config, head);
- `serving_export`: writes serving-engine folders beside the exported drafter (EAGLE-3: vLLM and
  speculators, serving.py), or None.

The evaluation stage registers its side of a drafter (tree builder, default tree, adaptation arms)
under the same name (evaluate/decoding/drafters.py); imports run one way, evaluate -> train, so the
two sides are two registries keyed by one name. An exported drafter names its spec in config.json
(`architecture`). A new drafter: a module (its nn.Module, config and, if it needs one, strategy, plus
the two registrations) and configs/drafter/<name>.yaml; tests/support/toy_drafter.py is one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hydra.core.config_store import ConfigStore
from torch import Tensor, nn
from transformers import PretrainedConfig

from .distill import DistillStrategy, SpecBlockStrategy
from .modeling import DrafterConfig, Eagle3Config, Eagle3Drafter, SpecBlockConfig, SpecBlockDrafter
from .serving import export_for_engines
from .strategy import DrafterStrategy

# (config, target config, embedding [V,H], LM head [V,H], d2t [Vd] or None) -> the drafter module
DrafterBuilder = Callable[[Any, PretrainedConfig, Tensor, Tensor, "Tensor | None"], nn.Module]
# (module, teacher or None, feature layers, LossConfig, StrategyConfig, TargetHead or None) -> strategy
StrategyBuilder = Callable[..., DrafterStrategy]
# (module, export folder, *, target_config, feature_layers, verifier) -> the folders written
ServingExport = Callable[..., list]


@dataclass(frozen=True)
class TrainSpec:
    """A drafter type as the training stage sees it (module docstring)."""

    name: str
    config: type[DrafterConfig]
    module: DrafterBuilder
    strategy: StrategyBuilder
    serving_export: ServingExport | None = None


TRAIN_SPECS: dict[str, TrainSpec] = {}


def register_drafter(spec: TrainSpec) -> TrainSpec:
    """Adds `spec` to the registry and its config to Hydra's ConfigStore (group drafter, base_<name>)."""
    if spec.name in TRAIN_SPECS:
        raise ValueError(f"drafter {spec.name!r} is registered twice")
    if spec.config().name != spec.name:
        raise ValueError(f"{spec.config.__name__}.name must default to the spec's name {spec.name!r}")
    TRAIN_SPECS[spec.name] = spec
    ConfigStore.instance().store(group="drafter", name=f"base_{spec.name}", node=spec.config)
    return spec


def train_spec(name: str) -> TrainSpec:
    if name not in TRAIN_SPECS:
        raise KeyError(f"unknown drafter {name!r}; registered: {sorted(TRAIN_SPECS)}")
    return TRAIN_SPECS[name]


def build_drafter(
    name: str,
    cfg: DrafterConfig | None,
    target_config: PretrainedConfig,
    embed_weight: Tensor,
    lm_head_weight: Tensor,
    d2t: Tensor | None = None,
) -> nn.Module:
    """The drafter registered as `name`, for a target with this config, embedding [V,H] and LM head
    [V,H]; cfg None = the drafter's default config; d2t None = the full vocabulary."""
    spec = train_spec(name)
    cfg = spec.config() if cfg is None else cfg
    if not isinstance(cfg, spec.config):
        raise TypeError(f"drafter {name!r} takes a {spec.config.__name__}, got {type(cfg).__name__}")
    return spec.module(cfg, target_config, embed_weight, lm_head_weight, d2t)


register_drafter(TrainSpec("specblock", SpecBlockConfig, SpecBlockDrafter, SpecBlockStrategy))
register_drafter(
    TrainSpec("eagle3", Eagle3Config, Eagle3Drafter, DistillStrategy, serving_export=export_for_engines)
)
