"""The evaluation stage: speculative decoding with exported drafters on the evaluation sets.

`evaluate(cfg)` loads the target and every drafter (in the target's precision, `target.dtype`; `auto` on a CPU
measured first: precision.py), generates for every (dataset, prompt, method, drafter) with the same seed per
prompt (autoregressive and lookup once, without a drafter), sums counts per (dataset, method) and writes
`results.jsonl`, `results.md` (datasets x methods) and `acceptance_at.png` under `cfg.output_dir`; sets with
categories (MT-Bench, Spec-Bench, a custom set's category field) also get `results_by_category.jsonl` and a
per-category table. A prompt with follow-up turns (mt_bench_turns=2) is decoded turn by turn: each follow-up
is asked after the same decoder's own answer, and every turn counts. At temperature 0 every scheme must
reproduce the target's greedy output; the report counts, per method, generations that do not
(`greedy_mismatches`: with a bf16 target, near-ties can flip between a tree forward and a one-token forward;
the report gives the top-2 logit gap where they diverge; in float32 there are none).
"""

from __future__ import annotations

import copy
import json
import logging
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any, NamedTuple

import torch
from tqdm.auto import tqdm

from specblock.data.config import DATASETS_ENV
from specblock.data.hardware import resolve_layout, set_weight_layout
from specblock.data.evalsets import EvalPrompt, EvalSet, EvalSetConfig, load_eval_set, turn_ids
from specblock.data.io import atomic_path
from specblock.data.manifest import tokenizer_hash
from specblock.data.target import DTYPES, FeatureTarget, eos_ids, load_target
from specblock.data.embedded import ensure_embedded_target
from specblock.train.export import load_drafter

from .adapt import Adapter
from .config import EvalConfig, parse_method
from .decoding.datastore import check_tokenizer
from .decoding.loop import DRAFTERLESS, DecodeConfig, Generation, SpeculativeDecoder
from .decoding.trees import AUTO, TreeConfig
from .precision import PrecisionProbe, measure_precision, needs_probe, precision_note
from .reporting.metrics import AUTOREGRESSIVE, BASELINE_SEP, Accumulator, is_autoregressive
from .reporting.report import (
    category_report,
    cost_table,
    markdown_report,
    plot_acceptance_at,
    records,
    write_jsonl,
)

log = logging.getLogger(__name__)

# local_root=auto reads the evaluation files from the folder this variable names (README "Evaluation data").
SEPARATOR = ":"  # method labels: "<drafter>:<method>", e.g. "specblock:tree"
# Seed offset of turn k of a prompt: a large prime, so that no turn of one prompt reuses the seed of
# another prompt's first turn (prompt i's first turn keeps seed * 100_003 + i, as before turns existed).
TURN_SEED_STRIDE = 1_000_003


def load_drafters(cfg: EvalConfig, target) -> dict[str, tuple[torch.nn.Module, dict]]:
    """Every exported drafter, on the target's device, in its dtype (the evaluation's precision) or in
    `cfg.drafter_dtype`."""
    target_vocab = target.config.get_text_config().vocab_size
    dtype = DTYPES[cfg.drafter_dtype] if cfg.drafter_dtype else target.dtype
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
        module = module.to(device=target.device, dtype=dtype)
        set_weight_layout(module, weight_layout(cfg))
        out[name] = (module, meta)
    return out


def local_root(cfg: EvalConfig) -> str | None:
    """`auto`: the folder named by $SPECBLOCK_DATASETS when set (it must exist), else None (the hub and
    packages)."""
    if cfg.local_root != "auto":
        return cfg.local_root
    root = os.environ.get(DATASETS_ENV)
    if root and not Path(root).is_dir():
        raise FileNotFoundError(f"{DATASETS_ENV}={root!r} is not a folder")
    return root or None


def load_set(cfg: EvalConfig, name: str):
    """One evaluation set from local_root; a set missing there comes from its package or the hub."""
    root = local_root(cfg)
    make = lambda r: EvalSetConfig(  # noqa: E731
        name=name,
        local_root=r,
        languages=cfg.mgsm_languages,
        limit=cfg.limit,
        seed=cfg.seed,
        on_bad_row=cfg.on_bad_row,
        mt_bench_turns=cfg.mt_bench_turns,
        hub_id=cfg.hub_ids.get(name),
        custom=cfg.custom,
    )
    try:
        return load_eval_set(make(root))
    except FileNotFoundError:
        if root is None:
            raise
        return load_eval_set(make(None))


def decode_config(cfg: EvalConfig, method: str, drafter: str | None) -> DecodeConfig:
    mode, verifier = parse_method(method)
    auto = cfg.draft_length == AUTO
    return DecodeConfig(
        mode=mode,
        verifier=verifier,
        num_drafts=cfg.num_drafts if mode == "iid" else 1,
        draft_length=cfg.max_draft_length if auto else cfg.draft_length,
        auto_length=auto and mode in ("chain", "iid"),
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


class Setup(NamedTuple):
    """What the stage decodes with (`build`): the target model and its tokenizer, the (label, decoder)
    runs in order (autoregressive first: the reference), the evaluation sets, the sets that could not
    be loaded (name -> why) and the precision probe."""

    model: Any
    tokenizer: Any
    runs: list[tuple[str, SpeculativeDecoder]]
    sets: list[EvalSet]
    unavailable: dict[str, str]
    probe: PrecisionProbe | None = None  # how target.dtype=auto was decided, where it was measured


class Decoded(NamedTuple):
    """What `generate` counted: per (dataset, method), per ("<dataset>/<category>", method), the greedy
    mismatches per method and, for each, the target's top-2 logit gap where it first left autoregressive
    decoding's tokens."""

    acc: Accumulator
    by_category: Accumulator
    mismatches: dict[str, int]
    gaps: dict[str, list[float]]


def evaluate(cfg: EvalConfig, resolved: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Runs the stage (module docstring): build, generate, write; returns the result records."""
    setup = build(cfg)
    decoded = generate(setup, cfg)
    return write(cfg, decoded, setup.unavailable, resolved, setup.probe)


def build(cfg: EvalConfig) -> Setup:
    """The target, the evaluation sets and one decoder per (method, drafter); with target.dtype=auto on a
    CPU, first the precision that decodes the first prompt fastest (evaluate/precision.py)."""
    Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
    ensure_embedded_target(cfg.target.name_or_path)
    model, tokenizer = load_target(cfg.target)
    if uses_datastore(cfg):
        check_tokenizer(cfg.lookup.datastore, tokenizer_hash(tokenizer))  # before minutes of decoding
    set_weight_layout(model, weight_layout(cfg))  # before any copy: the probe's and the baselines' keep it
    sets, unavailable = load_sets(cfg)
    eos, probe, copies = eos_ids(tokenizer, model), None, {}
    first = next((s.prompts[0] for s in sets if s.prompts), None)
    if needs_probe(cfg) and first is not None:
        model, probe, copies = measure_precision(cfg, model, tokenizer, first, decoders, eos)
    return Setup(model, tokenizer, decoders(cfg, model, eos, copies), sets, unavailable, probe)


def uses_datastore(cfg: EvalConfig) -> bool:
    """Whether a method that drafts with lookup runs with lookup's datastore."""
    return bool(cfg.lookup.datastore) and bool({"lookup", "tree+lookup"} & set(cfg.methods))


def weight_layout(cfg: EvalConfig) -> str:
    """cfg.weight_layout, `auto` resolved once (data/hardware.auto_layout) and written back."""
    cfg.weight_layout = resolve_layout(cfg.weight_layout, cfg.target.device)
    return cfg.weight_layout


LAYOUT_WORDS = {
    "row": "row-major linear weights",
    "column": "column-major linear weights",
    "packed": "linear layers on packed products (a packed copy of each weight: MKL's in float32, oneDNN's in "
    "bfloat16; data/packed.py)",
    "packed-float32": "linear layers on MKL's packed product in float32 (a packed copy of each weight, "
    "data/packed.py), plain in bfloat16",
    "packed-bfloat16": "linear layers on oneDNN's packed product in bfloat16 (a packed copy of each weight, "
    "data/packed.py), plain in float32",
    "transposed": "linear layers on the transposed product in float32 ((W x^T)^T over 2-128 rows, "
    "data/packed.py), plain in bfloat16",
    "transposed+packed-bfloat16": "linear layers on the transposed product in float32 and on oneDNN's packed "
    "product in bfloat16 (data/packed.py)",
}


def layout_note(layout: str) -> str:
    """The report's line on the weight layout every decoder used."""
    return (
        f"\nWeight layout (weight_layout): {LAYOUT_WORDS.get(layout, layout)} in every decoder, plain decoding "
        "included (weight_layout: row, column, packed, transposed, or auto: the one whose decoding-step products are "
        "measured fastest on this CPU, data/hardware.py).\n"
    )


def decoders(
    cfg: EvalConfig, model, eos: list[int], copies: dict[str, Any] | None = None
) -> list[tuple[str, SpeculativeDecoder]]:
    """(label, decoder): autoregressive first (the reference), then autoregressive in every precision of
    `cfg.baselines` ("autoregressive@float32", on a copy of the target: the fastest of them is the speedups'
    denominator; `copies[dtype]` where the precision probe made one already), then lookup, then every method
    of every drafter ("<drafter>:<method>", "+adapt" when it adapts while it serves)."""
    drafters = load_drafters(cfg, model) if cfg.drafter_methods else {}
    plain = FeatureTarget(model, cfg.target.feature_layers)
    runs = [
        (m, SpeculativeDecoder(plain, None, decode_config(cfg, m, None), eos))
        for m in DRAFTERLESS
        if m in cfg.methods
    ]
    for i, dtype in enumerate(cfg.baselines, 1):  # plain decoding in other precisions, after autoregressive
        other = (copies or {}).get(dtype)
        if other is None:
            other = copy.deepcopy(model).to(DTYPES[dtype])
        copy_in = FeatureTarget(other, cfg.target.feature_layers)
        dec = SpeculativeDecoder(copy_in, None, decode_config(cfg, AUTOREGRESSIVE, None), eos)
        runs.insert(i, (f"{AUTOREGRESSIVE}{BASELINE_SEP}{dtype}", dec))
    for name, (module, meta) in drafters.items():
        target = FeatureTarget(model, meta["feature_layers"])  # the layers this drafter was trained on
        for method in cfg.drafter_methods:
            adapter, drafter, suffix = None, module, ""
            if cfg.adapt.enabled:  # each run adapts its own copy, from the exported weights (reset per run)
                drafter = copy.deepcopy(module)
                adapter, suffix = Adapter(drafter, cfg.adapt), "+adapt"
            dec = SpeculativeDecoder(target, drafter, decode_config(cfg, method, name), eos, adapter=adapter)
            runs.append((f"{name}{SEPARATOR}{method}{suffix}", dec))
    return runs


def load_sets(cfg: EvalConfig) -> tuple[list[EvalSet], dict[str, str]]:
    """Every evaluation set that loads, and the ones that do not (name -> why; with on_unavailable=error
    the first one raises)."""
    sets, unavailable = [], {}
    for d in cfg.datasets:
        try:
            sets.append(load_set(cfg, d))
        except (RuntimeError, FileNotFoundError) as err:
            if cfg.on_unavailable == "error":
                raise
            unavailable[d] = str(err)
            log.warning(f"WARNING: skipping {d}: {err}")
    for s in sets:
        log.info(s.summary())
    return sets, unavailable


def write(
    cfg: EvalConfig,
    decoded: Decoded,
    unavailable: dict[str, str],
    resolved: dict[str, Any] | None,
    probe: PrecisionProbe | None = None,
) -> list[dict[str, Any]]:
    """results.jsonl, results.md (+ the per-category files), acceptance_at.png, the resolved config and
    W&B; returns the records."""
    out_dir = Path(cfg.output_dir)
    fields = record_fields(cfg)
    if probe is not None:  # each precision's ms per token in the probe
        fields["precision_probe"] = {"method": probe.method, "drafter": probe.drafter, **probe.ms_per_token}
    rows = records(decoded.acc, fields)
    for r in rows:
        r["greedy_mismatches"] = decoded.mismatches.get(r["method"], 0) if r["dataset"] == "overall" else None
    write_jsonl(out_dir / "results.jsonl", rows)
    report = markdown_report(rows) + cost_table(rows) + _mismatch_note(decoded.mismatches, decoded.gaps, cfg)
    report += precision_note(cfg.target, probe)
    report += layout_note(cfg.weight_layout)
    if uses_datastore(cfg):
        report += (
            f"\nLookup's datastore (lookup.datastore): where the context has no n-gram match, lookup drafts the most "
            f"frequent continuation in the answers of {cfg.lookup.datastore} (evaluate/decoding/datastore.py).\n"
        )
    if decoded.by_category.datasets():
        category_rows = records(decoded.by_category, fields)
        write_jsonl(out_dir / "results_by_category.jsonl", category_rows)
        report += category_report(category_rows)
    if unavailable:
        report += "\nSkipped evaluation sets (not available here): " + ", ".join(unavailable) + "\n"
    with atomic_path(out_dir / "results.md") as tmp:
        tmp.write_text(report)
    plot_acceptance_at([r for r in rows if not is_autoregressive(r["method"])], out_dir / "acceptance_at.png")
    if resolved is not None:  # written last: `specblock run` reads its presence as "this stage is done"
        with atomic_path(out_dir / "config.json") as tmp:
            tmp.write_text(json.dumps(resolved, indent=2, sort_keys=True, default=str))
    _log_wandb(cfg, rows, out_dir)
    log.info(report)
    log.info(
        f"results: {out_dir / 'results.jsonl'}, {out_dir / 'results.md'}, {out_dir / 'acceptance_at.png'}"
    )
    return rows


def record_fields(cfg: EvalConfig) -> dict[str, Any]:
    """The configuration every result record carries (what a sweep varies)."""
    return {
        "K": cfg.num_drafts,
        "L": cfg.draft_length,
        "temperature": cfg.temperature,
        "top_p": cfg.top_p,
        "dtype": cfg.target.dtype,  # of the target (auto resolved)
        "drafter_dtype": cfg.drafter_dtype or cfg.target.dtype,
        "weight_layout": cfg.weight_layout,
        "max_new_tokens": cfg.max_new_tokens,
        "limit": cfg.limit,
        "trees": {k: asdict(v) for k, v in cfg.trees.items()},
        "lookup": asdict(cfg.lookup),
    }


def divergence_gap(model, prompt: list[int], reference: list[int], tokens: list[int]) -> float:
    """The target's top-2 logit gap where `tokens` first leaves `reference` (one forward over the prompt
    and their common prefix, in the evaluation's precision): how near a tie the flipped choice was."""
    n = min(len(reference), len(tokens))
    i = next((j for j in range(n) if reference[j] != tokens[j]), n)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + reference[:i]], device=model.device)).logits[0, -1]
    top = logits.float().topk(2).values
    return float(top[0] - top[1])


def generate_turns(
    dec: SpeculativeDecoder, prompt: EvalPrompt, tokenizer, cfg: EvalConfig, seed: int
) -> list[Generation]:
    """Every turn of `prompt` with one decoder: the first, then each follow-up asked after this decoder's
    own (decoded) answer to the previous turn."""
    gens: list[Generation] = []
    answers: list[str] = []
    for turn in range(1 + len(prompt.followups)):
        ids = turn_ids(prompt, answers, tokenizer)[-cfg.max_prompt_tokens :]
        gens.append(dec.generate(ids, seed=seed + turn * TURN_SEED_STRIDE))
        answers.append(tokenizer.decode(gens[-1].tokens, skip_special_tokens=True))
    return gens


def generate(setup: Setup, cfg: EvalConfig) -> Decoded:
    """Every (prompt, run): counts per (dataset, method), per ("<dataset>/<category>", method) for
    prompts with a category, the greedy mismatches per method (turn by turn) and, for each, the target's
    top-2 logit gap where it first left the autoregressive tokens."""
    sets, runs, model, tokenizer = setup.sets, setup.runs, setup.model, setup.tokenizer
    acc, by_category, mismatches, gaps = Accumulator(), Accumulator(), {}, {}
    bar = tqdm(total=sum(len(s) for s in sets) * len(runs), desc="evaluate", unit="gen")
    for s in sets:
        for i, prompt in enumerate(s.prompts):
            reference = None
            for label, dec in runs:
                bar.set_postfix_str(f"{prompt.dataset} {label}")
                gens = generate_turns(dec, prompt, tokenizer, cfg, seed=cfg.seed * 100_003 + i)
                for g in gens:
                    record(acc, prompt.dataset, label, g)
                    if prompt.category is not None:
                        record(by_category, f"{prompt.dataset}/{prompt.category}", label, g)
                tokens = [g.tokens for g in gens]
                if label == AUTOREGRESSIVE:
                    reference = tokens
                # plain decoding in another precision is a timing reference, not a method to compare
                elif (
                    cfg.temperature == 0
                    and reference is not None
                    and not is_autoregressive(label)
                    and tokens != reference
                ):
                    mismatches[label] = mismatches.get(label, 0) + 1
                    gaps.setdefault(label, []).append(
                        first_gap(model, prompt, reference, tokens, tokenizer, cfg)
                    )
                bar.update()
    bar.close()
    return Decoded(acc, by_category, mismatches, gaps)


def first_gap(
    model, prompt: EvalPrompt, reference: list[list[int]], tokens: list[list[int]], tokenizer, cfg
) -> float:
    """divergence_gap at the first turn where `tokens` leaves `reference`, that turn asked after the
    reference's own earlier answers."""
    turn = next(k for k, (a, b) in enumerate(zip(reference, tokens)) if a != b)
    answers = [tokenizer.decode(t, skip_special_tokens=True) for t in reference[:turn]]
    ids = turn_ids(prompt, answers, tokenizer)[-cfg.max_prompt_tokens :]
    return divergence_gap(model, ids, reference[turn], tokens[turn])


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
