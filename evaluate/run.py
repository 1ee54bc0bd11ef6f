"""The evaluation stage: speculative decoding with exported drafters on the evaluation sets.

`evaluate(cfg)` loads the target and every drafter (in the target's precision, `target.dtype`),
generates for every (dataset, prompt, method, drafter) with the same seed per prompt (autoregressive and
lookup once, without a drafter), sums counts per (dataset, method) and writes `results.jsonl`,
`results.md` (datasets x methods) and `acceptance_at.png` under `cfg.output_dir`. At temperature 0
every scheme must reproduce the target's greedy output; the report counts, per method, generations that
do not (`greedy_mismatches`: with a bf16 target, near-ties can flip between a tree forward and a
one-token forward; the report gives the top-2 logit gap where they diverge; in float32 there are none).
"""

from __future__ import annotations

import copy
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from specblock.data.evalsets import EvalSetConfig, load_eval_set, prompt_ids
from specblock.data.io import atomic_path
from specblock.data.target import FeatureTarget, ensure_embedded_target, load_target
from specblock.train.export import load_drafter

from .adapt import Adapter
from .config import EvalConfig, parse_method
from .decode import DRAFTERLESS, DecodeConfig, Generation, SpeculativeDecoder
from .drafting import TreeConfig
from .metrics import AUTOREGRESSIVE, Accumulator
from .report import cost_table, markdown_report, plot_acceptance_at, records, write_jsonl

AUTO_ROOT = "../shared/datasets"
SEPARATOR = ":"  # method labels: "<drafter>:<method>", e.g. "specblock:tree"


def eos_ids(tokenizer, model) -> list[int]:
    """End-of-sequence ids: the tokenizer's and the generation config's (chat models end turns there)."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if gen_eos is not None:
        ids.update([gen_eos] if isinstance(gen_eos, int) else gen_eos)
    return sorted(ids)


def load_drafters(cfg: EvalConfig, target) -> dict[str, tuple[torch.nn.Module, dict]]:
    """Every exported drafter, on the target's device and in its dtype (the evaluation's precision)."""
    target_vocab = target.config.get_text_config().vocab_size
    out = {}
    for name, folder in cfg.drafters.items():
        if not (Path(folder) / "config.json").exists():
            raise FileNotFoundError(
                f"drafters.{name}: no exported drafter in {folder} (train one: python -m specblock.train "
                "experiment=quick, or run the whole pipeline: specblock run)"
            )
        module, meta = load_drafter(folder)
        vocab = meta["target"]["config"]["vocab_size"]
        if vocab != target_vocab:
            raise ValueError(
                f"drafters.{name} ({folder}) was trained for a vocabulary of {vocab}, the target has {target_vocab}"
            )
        out[name] = (module.to(device=target.device, dtype=target.dtype), meta)
    return out


def local_root(cfg: EvalConfig) -> str | None:
    """`auto`: the reference datasets folder next to the repository (../shared/datasets) if it exists."""
    if cfg.local_root == "auto":
        return AUTO_ROOT if Path(AUTO_ROOT).is_dir() else None
    return cfg.local_root


def load_set(cfg: EvalConfig, name: str):
    """One evaluation set from local_root; a set missing there comes from its package or the hub."""
    root = local_root(cfg)
    make = lambda r: EvalSetConfig(  # noqa: E731
        name=name,
        local_root=r,
        languages=cfg.mgsm_languages,
        limit=cfg.limit,
        seed=cfg.seed,
        on_bad_row="skip",
    )
    try:
        return load_eval_set(make(root))
    except FileNotFoundError:
        if root is None:
            raise
        return load_eval_set(make(None))


def decode_config(cfg: EvalConfig, method: str, drafter: str | None) -> DecodeConfig:
    mode, verifier = parse_method(method)
    return DecodeConfig(
        mode=mode,
        verifier=verifier,
        num_drafts=cfg.num_drafts if mode == "iid" else 1,
        draft_length=cfg.draft_length,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        max_new_tokens=cfg.max_new_tokens,
        tree=cfg.trees.get(drafter, TreeConfig()),
        lookup=cfg.lookup,
    )


def record(acc: Accumulator, dataset: str, label: str, g: Generation) -> None:
    for it in g.iterations:
        acc.add_iteration(
            dataset,
            label,
            accepted=it.accepted,
            emitted=it.emitted,
            draft_len=it.draft_len,
            drafter_calls=it.drafter_calls,
            drafter_seconds=it.drafter_seconds,
            verify_seconds=it.verify_seconds,
            target_seconds=it.target_seconds,
        )
    acc.add_generation(
        dataset, label, tokens=len(g.tokens), seconds=g.seconds, target_calls=g.prefill_calls,
        # an iteration's forward is in its stats; autoregressive steps and the prefill only here
        target_seconds=g.prefill_target_seconds + (0.0 if g.iterations else g.target_seconds),
        drafter_calls=g.prefill_drafter_calls, drafter_seconds=g.prefill_drafter_seconds,
    )  # fmt: skip


def evaluate(cfg: EvalConfig, resolved: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Runs the stage (module docstring); returns the result records."""
    out_dir = Path(cfg.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ensure_embedded_target(cfg.target.name_or_path)
    model, tokenizer = load_target(cfg.target)
    speculative = cfg.drafter_methods
    drafters = load_drafters(cfg, model) if speculative else {}
    eos = eos_ids(tokenizer, model)
    plain = FeatureTarget(model, cfg.target.feature_layers)
    runs = [  # (label, decoder): autoregressive first (the reference), then lookup, then every drafter
        (m, SpeculativeDecoder(plain, None, decode_config(cfg, m, None), eos))
        for m in DRAFTERLESS
        if m in cfg.methods
    ]
    for name, (module, meta) in drafters.items():
        target = FeatureTarget(model, meta["feature_layers"])  # the layers this drafter was trained on
        for method in speculative:
            adapter, drafter, suffix = None, module, ""
            if cfg.adapt.enabled:  # each run adapts its own copy, from the exported weights (reset per run)
                drafter = copy.deepcopy(module)
                adapter, suffix = Adapter(drafter, cfg.adapt), "+adapt"
            dec = SpeculativeDecoder(target, drafter, decode_config(cfg, method, name), eos, adapter=adapter)
            runs.append((f"{name}{SEPARATOR}{method}{suffix}", dec))
    sets, unavailable = [], {}
    for d in cfg.datasets:
        try:
            sets.append(load_set(cfg, d))
        except (RuntimeError, FileNotFoundError) as err:
            if cfg.on_unavailable == "error":
                raise
            unavailable[d] = str(err)
            print(f"WARNING: skipping {d}: {err}")
    for s in sets:
        print(s.summary())
    acc, mismatches, gaps = Accumulator(), {}, {}
    total = sum(len(s) for s in sets) * len(runs)
    bar = tqdm(total=total, desc="evaluate", unit="gen")
    for s in sets:
        for i, prompt in enumerate(s.prompts):
            ids = prompt_ids(prompt, tokenizer)[-cfg.max_prompt_tokens :]
            reference = None
            for label, dec in runs:
                bar.set_postfix_str(f"{prompt.dataset} {label}")
                g = dec.generate(ids, seed=cfg.seed * 100_003 + i)
                record(acc, prompt.dataset, label, g)
                if label == AUTOREGRESSIVE:
                    reference = g.tokens
                elif cfg.temperature == 0 and reference is not None and g.tokens != reference:
                    mismatches[label] = mismatches.get(label, 0) + 1
                    gaps.setdefault(label, []).append(divergence_gap(model, ids, reference, g.tokens))
                bar.update()
    bar.close()
    fields = {
        "K": cfg.num_drafts,
        "L": cfg.draft_length,
        "temperature": cfg.temperature,
        "top_p": cfg.top_p,
        "dtype": cfg.target.dtype,  # of the target and every drafter (auto resolved)
        "max_new_tokens": cfg.max_new_tokens,
        "limit": cfg.limit,
        "trees": {k: asdict(v) for k, v in cfg.trees.items()},
    }
    rows = records(acc, fields)
    for r in rows:
        r["greedy_mismatches"] = mismatches.get(r["method"], 0) if r["dataset"] == "overall" else None
    write_jsonl(out_dir / "results.jsonl", rows)
    report = markdown_report(rows) + cost_table(rows) + _mismatch_note(mismatches, gaps, cfg)
    if unavailable:
        report += "\nSkipped evaluation sets (not available here): " + ", ".join(unavailable) + "\n"
    with atomic_path(out_dir / "results.md") as tmp:
        tmp.write_text(report)
    plot_acceptance_at([r for r in rows if r["method"] != AUTOREGRESSIVE], out_dir / "acceptance_at.png")
    if resolved is not None:  # written last: `specblock run` reads its presence as "this stage is done"
        with atomic_path(out_dir / "config.json") as tmp:
            tmp.write_text(json.dumps(resolved, indent=2, sort_keys=True, default=str))
    _log_wandb(cfg, rows, out_dir)
    print(report)
    print(f"results: {out_dir / 'results.jsonl'}, {out_dir / 'results.md'}, {out_dir / 'acceptance_at.png'}")
    return rows


def divergence_gap(model, prompt: list[int], reference: list[int], tokens: list[int]) -> float:
    """The target's top-2 logit gap where `tokens` first leaves `reference` (one forward over the prompt
    and their common prefix, in the evaluation's precision): how near a tie the flipped choice was."""
    n = min(len(reference), len(tokens))
    i = next((j for j in range(n) if reference[j] != tokens[j]), n)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + reference[:i]], device=model.device)).logits[0, -1]
    top = logits.float().topk(2).values
    return float(top[0] - top[1])


def _mismatch_note(mismatches: dict[str, int], gaps: dict[str, list[float]], cfg: EvalConfig) -> str:
    if cfg.temperature != 0:
        return ""
    if not mismatches:
        return "\nAt temperature 0 every method reproduced the target's greedy output exactly.\n"
    items = ", ".join(f"{k}: {v}" for k, v in mismatches.items())
    widest = max(g for gs in gaps.values() for g in gs)
    return (
        f"\nGreedy outputs that differ from autoregressive decoding ({items}; column greedy ≠ "
        f"autoregressive). With target.dtype={cfg.target.dtype} a token's logits depend on the shape of the "
        "forward that computes them (one token, or a tree of N: other kernel blocking and accumulation "
        "order), so where the two best logits nearly tie the argmax can flip; every decoding stays exact "
        "for the forwards it runs, and in float32 no flip is expected. At the first differing token the "
        f"target's top-2 logit gap was at most {widest:.3g} here (near-ties).\n"
    )


def _log_wandb(cfg: EvalConfig, rows: list[dict[str, Any]], out_dir: Path) -> None:
    if cfg.logger != "wandb":
        return
    import wandb

    run = wandb.init(project=cfg.project, name=cfg.run_name, dir=str(out_dir), job_type="eval")
    cols = ["dataset", "method", "tau", "block_efficiency", "tokens_per_second", "speedup"]
    table = wandb.Table(columns=cols)
    for r in rows:
        m = r["metrics"]
        table.add_data(
            r["dataset"], r["method"], m["tau"], m["block_efficiency"], m["tokens_per_second"], m["speedup"]
        )
    run.log({"results": table})
    run.finish()
