"""The A/B harness of the loop-change scripts (ab_tree_rounds, ab_shared_cache, ab_tree_lookup): a change
measured against the rule before it, in one process, on bench_decode's decoders."""

from __future__ import annotations

import logging
import sys
from typing import Callable

import torch

from bench_decode import decoders, decoding_table, interleave, load_prompts, parse_args
from specblock.data.hardware import resolve_layout, set_weight_layout
from specblock.data.logs import setup_logging
from specblock.data.target import TargetConfig, load_target
from specblock.evaluate.run import eos_ids

log = logging.getLogger(__name__)


def ab_tree_auto(
    old: str,
    variant,
    argv: list[str] | None = None,
    base: str = "tree@auto",
    more: dict | None = None,
    dtype: str = "bfloat16",
) -> None:
    """An A/B of a loop change in one process: `base` (default tree@auto) now against `variant(decoder)`
    (the rule before, named `old`), with autoregressive decoding, in `dtype` (bf16), T = 0, 1 thread,
    prompts interleaved, median of the repeats; defaults: the cpu_full SpecBlock drafter, 64 new tokens on
    GSM8K. `more`: further variants, name -> function of the base decoder. Prints the decoding table."""
    setup_logging()
    defaults = [
        "--methods",
        "autoregressive",
        "tree@auto",
        "--drafter",
        "checkpoints/cpu_full-specblock/drafter",
    ]
    defaults += ["--dataset", "gsm8k", "--max-new-tokens", "64", "--repeats", "2", "--threads", "1"]
    args = parse_args([*defaults, *(sys.argv[1:] if argv is None else argv), "--dtype", dtype])
    torch.set_num_threads(args.threads)
    run_variants(args, {name: (base, fn) for name, fn in {old: variant, **(more or {})}.items()})


def run_variants(args, variants: dict[str, tuple[str, Callable]]) -> None:
    """bench_decode's decoders for `args` (its first --dtype and --layout), plus each variant: name ->
    (the method whose decoder it starts from, a function of that decoder), decoded side by side (prompts
    interleaved, median of the repeats); logs the decoding table."""
    dtype = args.dtype[0]
    model, tok = load_target(TargetConfig(name_or_path=args.target, dtype=dtype))
    layout = resolve_layout(args.layout[0], args.device)  # target and drafter alike
    set_weight_layout(model, layout)
    prompts, eos = load_prompts(args, tok), eos_ids(tok, model)
    decs = decoders(args, model, eos, layout)
    for name, (base, fn) in variants.items():
        decs[name] = fn(decoders(args, model, eos, layout)[base])
    log.info(
        f"weight layout {layout}; {len(prompts)} {args.dataset} prompts, {args.max_new_tokens} new tokens"
    )
    log.info(decoding_table(interleave({dtype: decs}, args, prompts), args.temperature))
