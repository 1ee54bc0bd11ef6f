"""Does compiling the drafter's decoding calls pay? (issue 12; measured in session 31, not kept)

    SPECBLOCK_DATASETS=../shared/datasets python scripts/ab_compile_drafter.py --drafter checkpoints/quick-specblock/drafter

The drafter's `extend` / `draft` compiled by inductor (dynamic shapes, `freezing`: the weights as constants,
prepacked by inductor, so the drafter is stored row-major first) against the eager drafter on oneDNN's
packed bf16 product (`weight_layout=auto` here), both in bf16:
1. per call: `extend` of 1-4 verified positions after a prompt's cache, the cache growing call by call as
   in the loop (a fixed cache stays in the CPU's caches and flatters both), median ms after a warm-up
   whose seconds (the first compilations) are printed; `TORCH_LOGS=recompiles` names every later one;
2. in the loop: `tree@auto` on `--prompts` prompts, one untimed pass over all of them first (compilation
   there, not in the timed passes), then bench_decode's `interleave` (`--repeats` passes) and `Split`:
   tokens/s (end to end, the median of the passes), tokens per iteration and drafter ms per call (the
   decoding phase, prefill excluded). Session 31's figures summed all passes, prefill included.
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, "scripts")
import bench_decode as bd
from specblock.data.hardware import resolve_layout, set_weight_layout
from specblock.data.target import TargetConfig, load_target
from specblock.evaluate.run import eos_ids
from specblock.train.export import load_drafter


def compiled(drafter: torch.nn.Module) -> torch.nn.Module:
    """A copy whose extend / draft run through torch.compile (positions as 0-d tensors: as ints every new
    value compiles again)."""
    out = copy.deepcopy(drafter)
    set_weight_layout(out, "row")  # inductor's freezing prepacks; our packed layout is a Python-level swap
    torch._dynamo.config.cache_size_limit = 64
    for name in ("extend", "draft"):
        fn = torch.compile(getattr(type(out), name).__get__(out), dynamic=True, options={"freezing": True})

        def call(*args, _fn=fn, **kwargs):
            for key in ("position", "offset"):
                if isinstance(kwargs.get(key), int):
                    kwargs[key] = torch.tensor(kwargs[key])
            return _fn(*args, **kwargs)

        call.__wrapped__ = getattr(type(out), name)  # DrafterSession reads extend's signature
        object.__setattr__(out, name, call)
    return out


@torch.no_grad()
def per_call_ms(drafter, context: int, calls: int, seed: int = 0) -> list[float]:
    rng, F = random.Random(seed), drafter.feature_size
    gen = torch.Generator().manual_seed(seed)
    cond = torch.randn(1, context + 4 * calls, F, generator=gen).bfloat16()
    tokens = torch.randint(0, drafter.t2d.numel(), (1, context + 4 * calls), generator=gen)  # target ids
    step = drafter.extend(cond[:, :context], tokens[:, :context], None, position=0, last_only=True)
    pos, out = context, []
    for _ in range(calls):
        n = rng.randint(1, 4)
        start = time.perf_counter()
        step = drafter.extend(
            cond[:, pos : pos + n], tokens[:, pos : pos + n], step.cache, position=pos, last_only=True
        )
        out.append((time.perf_counter() - start) * 1e3)
        pos += n
    return out


def loop_ab(args, model, tok, eos, drafters: dict, meta: dict) -> None:
    ns = bd.parse_args(
        [
            "--methods",
            "tree@auto",
            "--dataset",
            args.dataset,
            "--prompts",
            str(args.prompts),
            "--drafter",
            args.drafter,
            "--repeats",
            str(args.repeats),
        ]
    )
    prompts = bd.load_prompts(ns, tok)
    layers = meta["feature_layers"]
    decs = {
        name: bd.method_decoders(ns, model, eos, ["tree@auto"], d, layers, meta)["tree@auto"]
        for name, d in drafters.items()
    }
    for name, dec in decs.items():
        start = time.perf_counter()
        for i, p in enumerate(prompts):
            dec.generate(p, seed=i)
        print(f"untimed pass, {name}: {time.perf_counter() - start:.1f} s", flush=True)
    splits = {name: split for (_, name), split in bd.interleave({"bfloat16": decs}, ns, prompts).items()}
    print("| drafter | tokens / s (median) | tokens / iteration | drafter ms / call |\n|---|---|---|---|")
    for name, s in splits.items():
        print(
            f"| {name} | {s.tokens_per_second():.1f} | {s.tokens / max(s.iterations, 1):.2f} "
            f"| {1e3 * s.draft / max(s.calls, 1):.2f} |"
        )


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--dataset", default="gsm8k")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--calls", type=int, default=60)
    args = ap.parse_args()
    model, tok = load_target(TargetConfig(dtype="bfloat16"))
    layout = resolve_layout("auto", "cpu")
    set_weight_layout(model, layout)
    module, meta = load_drafter(args.drafter)
    module = module.to(torch.bfloat16).eval()
    set_weight_layout(module, layout)
    drafters = {f"eager ({layout})": module, "compiled (row, freezing)": compiled(module)}
    for name, d in drafters.items():
        start = time.perf_counter()
        per_call_ms(d, args.context, 8, seed=1)  # warm-up: compilation, kernel selection
        warm = time.perf_counter() - start
        ms = per_call_ms(d, args.context, args.calls)
        print(
            f"{name}: extend of 1-4 positions, median {statistics.median(ms):.2f} ms (warm-up {warm:.1f} s)"
        )
    loop_ab(args, model, tok, eos_ids(tok, model), drafters, meta)
