"""Typed configs of the evaluation stage, registered with Hydra's ConfigStore (YAML only overrides)."""

from __future__ import annotations

from dataclasses import dataclass

from hydra.core.config_store import ConfigStore

from .verify import SINGLE_DRAFT, TREE_MODES, VERIFIERS


@dataclass
class VerifierConfig:
    """Which verifier runs and on what drafts: K drafts (num_drafts) of L tokens (draft_length)."""

    name: str = "spectr_gbv"
    num_drafts: int = 4
    draft_length: int = 4
    tree_mode: str = "deterministic"  # only for name = "tree": sampled | deterministic | greedy

    def __post_init__(self):
        if self.name != "tree" and self.name not in VERIFIERS:
            raise ValueError(f"verifier.name={self.name!r} is not one of {sorted(VERIFIERS) + ['tree']}")
        if self.name == "tree" and self.tree_mode not in TREE_MODES:
            raise ValueError(f"verifier.tree_mode={self.tree_mode!r} is not one of {TREE_MODES}")
        if self.num_drafts < 1 or self.draft_length < 1:
            raise ValueError(f"verifier needs num_drafts >= 1 and draft_length >= 1, got {self}")
        if self.name in SINGLE_DRAFT and self.num_drafts != 1:
            raise ValueError(f"verifier {self.name!r} takes a single draft; set verifier.num_drafts=1")


def register_configs() -> None:
    cs = ConfigStore.instance()
    cs.store(group="verifier", name="base_verifier", node=VerifierConfig)
