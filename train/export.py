"""Export a trained drafter as a self-describing folder, and load it back (no pickles, no code).

    <out>/config.json        architecture, drafter config, K, draft vocab size, feature layers, target id,
                             revision and config (enough to rebuild the module without the target)
    <out>/model.safetensors  the drafter's full state dict (frozen embedding included)
    <out>/vocab_map.safetensors  d2t [Vd] (draft id -> target id) and t2d [V]
    <out>/README.md          model card: training data, steps, measured acceptance

`export_checkpoint` exports the drafter a step folder holds (ZeRO shards merged), plus the serving
engines' folders where the drafter type has them (`serving.py`); the training run calls it at the end, and

    python -m specblock.train.export --run checkpoints/<run_name> [--step latest] [--out DIR]
re-exports from a training checkpoint (its resolved config.yaml says how to rebuild the drafter).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, PretrainedConfig

from specblock.data.errors import exit_on_user_error
from specblock.data.io import atomic_path
from specblock.data.logs import setup_logging
from specblock.data.target import default_feature_layers, load_target_config

from .checkpoint import read_model_state, resolve_resume
from .config import TrainConfig, saved_run_config
from .drafters import build_drafter, train_spec
from .serving import ServingExportError
from .tracking import log0

EXPORT_FORMAT = "specblock-drafter/1"


def export_drafter(
    module: torch.nn.Module,
    out_dir: str | Path,
    *,
    name: str,
    drafter_cfg: Any,
    target_config: PretrainedConfig,
    target_id: str,
    target_revision: str | None,
    feature_layers: list[int],
    card: dict[str, Any] | None = None,
    trained_blocks: int | None = None,
) -> Path:
    """Writes the drafter folder atomically (temporary name, then rename) and returns its path.
    trained_blocks: how many block rounds training ran per step (SpecBlock's `strategy.num_ttt_blocks`),
    recorded so that the evaluation drafts no untrained rounds (evaluate/config.py); None leaves it out."""
    out_dir = Path(out_dir)
    state = {k: v.detach().cpu().contiguous() for k, v in module.state_dict().items()}
    config = {
        "format": EXPORT_FORMAT,
        "architecture": name,
        "drafter": asdict(drafter_cfg),
        "block_size": int(module.block_size),
        "draft_vocab_size": int(module.d2t.numel()),
        "feature_layers": list(feature_layers),
        "target": {"id": target_id, "revision": target_revision, "config": target_config.to_dict()},
    }
    if trained_blocks is not None:
        config["trained_blocks"] = int(trained_blocks)
    with atomic_path(out_dir) as tmp:
        tmp.mkdir()
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": EXPORT_FORMAT})
        save_file(
            {"d2t": state["d2t"], "t2d": state["t2d"].to(torch.uint8)}, str(tmp / "vocab_map.safetensors")
        )
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        (tmp / "README.md").write_text(model_card(config, card or {}))
    return out_dir


def model_card(config: dict[str, Any], card: dict[str, Any]) -> str:
    metrics = card.get("metrics", {})
    acc = {k: v for k, v in sorted(metrics.items()) if "top1_" in k and "/" not in k.removeprefix("train/")}
    lines = [
        f"# {config['architecture']} drafter for {config['target']['id']}",
        "",
        f"A speculative-decoding drafter made by specblock ({EXPORT_FORMAT}): K = {config['block_size']} "
        f"draft positions per forward, draft vocabulary {config['draft_vocab_size']}, target feature layers "
        f"{config['feature_layers']} (hidden_states indices).",
        "",
        "## Training",
        "",
        f"- data: {card.get('data', 'n/a')}",
        f"- steps: {card.get('steps', 'n/a')}",
        f"- run config: {card.get('run', 'n/a')}",
        *([f"- initialised from: {card['init_from']}"] if "init_from" in card else []),
        *(
            [f"- decoder layers initialised from: the {card['init_layers']}'s top layers"]
            if "init_layers" in card
            else []
        ),
        *(
            [
                f"- exported step: {card['best']['step']}, the best by {card['best']['metric']} = "
                f"{card['best']['value']:.4f} on the held-out split"
            ]
            if "best" in card
            else []
        ),
        "",
        "## Measured (last logging window of training; teacher-forced)",
        "",
        "| metric | value |",
        "|---|---|",
    ]
    accept = metrics.get("train/accept_len")
    lines.append(
        f"| simulated acceptance length (draft tokens per block, greedy) | {accept:.3f} |"
        if accept is not None
        else "| simulated acceptance length | n/a |"
    )
    lines += [f"| {k.removeprefix('train/')} | {v:.3f} |" for k, v in acc.items()]
    val = {
        k: v for k, v in sorted(metrics.items()) if k.startswith("val/") and ("top1_" in k or "accept" in k)
    }
    lines += [f"| held-out {k.removeprefix('val/')} (last validation) | {v:.3f} |" for k, v in val.items()]
    lines += [
        "",
        "Load with `specblock.train.export.load_drafter(folder)`; the target is not needed to load it.",
        "",
    ]
    return "\n".join(lines)


def export_config(folder: str | Path) -> dict[str, Any]:
    """An exported drafter folder's config.json, checked to be ours (`format`)."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found (expected an exported drafter folder)")
    config = json.loads(path.read_text())
    if config.get("format") != EXPORT_FORMAT:
        raise ValueError(f"{path}: format {config.get('format')!r}, expected {EXPORT_FORMAT!r}")
    return config


def load_drafter(folder: str | Path) -> tuple[torch.nn.Module, dict[str, Any]]:
    """Rebuilds the exported drafter (eval mode) and returns it with its config.json."""
    folder = Path(folder)
    config = export_config(folder)
    name = config["architecture"]
    target_dict = dict(config["target"]["config"])
    target_config = AutoConfig.for_model(target_dict.pop("model_type"), **target_dict)
    state = load_file(str(folder / "model.safetensors"))
    module = rebuild_drafter(name, train_spec(name).config(**config["drafter"]), target_config, state)
    return module.eval(), config


def rebuild_drafter(
    name: str, drafter_cfg: Any, target_config: PretrainedConfig, state: dict[str, torch.Tensor]
):
    """A fresh drafter holding `state` (a full state dict, e.g. merged from ZeRO-3 shards); the
    target is not needed."""
    vocab, hidden = target_config.vocab_size, target_config.hidden_size
    module = build_drafter(
        name, drafter_cfg, target_config, torch.zeros(vocab, hidden), torch.zeros(vocab, hidden), state["d2t"]
    )
    module.load_state_dict(state, strict=True)
    return module


def export_checkpoint(
    cfg: TrainConfig, step: Path, out: str | Path, target_config: PretrainedConfig, card: dict | None = None
) -> Path:
    """Export the drafter stored in a step folder (merged from ZeRO shards if need be) to `out`."""
    layers = cfg.data.target.feature_layers or default_feature_layers(target_config.num_hidden_layers)
    drafter_cfg = replace(cfg.drafter, num_feature_layers=len(layers))
    module = rebuild_drafter(cfg.drafter.name, drafter_cfg, target_config, read_model_state(step))
    path = export_drafter(
        module,
        out,
        name=cfg.drafter.name,
        drafter_cfg=drafter_cfg,
        target_config=target_config,
        target_id=cfg.data.target.target_id,
        target_revision=cfg.data.target.revision,
        feature_layers=layers,
        card=card,
        trained_blocks=cfg.strategy.num_ttt_blocks if cfg.drafter.name == "specblock" else None,
    )
    serve = train_spec(cfg.drafter.name).serving_export  # beside it, e.g. <out>-vllm, <out>-speculators
    if serve is not None:
        try:
            verifier = cfg.data.target.name_or_path
            for folder in serve(
                module, path, target_config=target_config, feature_layers=layers, verifier=verifier
            ):
                log0(f"exported for serving engines: {folder}")
        except ServingExportError as err:  # the project's own folder is written; only the engines' is not
            log0(f"not exported for serving engines: {err}")
    return path


def export_from_checkpoint(run_dir: Path, step: str = "latest", out: str | None = None) -> Path:
    """Re-export a run's drafter from one of its checkpoints (python -m specblock.train.export). Reads
    only the run's config.yaml, the step folder and the target's config: no data stage, no weights."""
    cfg: TrainConfig = OmegaConf.to_object(saved_run_config(run_dir))
    target_config = load_target_config(cfg.data.target)
    path = resolve_resume(step if step == "latest" else str(run_dir / step), cfg.trainer.output_dir)
    return export_checkpoint(cfg, path, out or run_dir / "drafter", target_config)


@exit_on_user_error
def main(argv: list[str] | None = None) -> None:
    setup_logging()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", required=True, help="a training run folder (holds config.yaml and step_XXXXXX/)")
    ap.add_argument("--step", default="latest", help="'latest' or a step folder name")
    ap.add_argument("--out", default=None, help="default: <run>/drafter")
    args = ap.parse_args(argv)
    print(export_from_checkpoint(Path(args.run), args.step, args.out))


if __name__ == "__main__":
    main()
