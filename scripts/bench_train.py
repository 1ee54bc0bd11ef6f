"""Training throughput of each drafter on a real target: tokens/s, peak memory, and the drafter's
forward+backward+optimizer time against the target's forward on the same batch (aim: at most 0.5x).

    python scripts/bench_train.py                                  # SmolLM2-135M, B=4, T=256, CPU
    python scripts/bench_train.py --device cuda --dtype bfloat16 --batch 8 --length 1024

Online features: the target forward runs inside the step. Offline: the features come from a cache, so
a step is the drafter's work plus the frozen head's logits over the draft vocabulary (the target's
full-vocabulary argmax comes from beside the cache, as in a training run: data/target_argmax.py). Each configuration runs in its own process so
that its peak memory is its own.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import subprocess
import sys
import time

import torch

from specblock.data.logs import setup_logging
from specblock.data.target import (
    DEFAULT_TARGET_DIR,
    TargetConfig,
    TargetHead,
    concat_features,
    default_feature_layers,
    load_target,
)
from specblock.data.embedded import ensure_embedded_target
from specblock.train.losses import LossConfig
from specblock.train.drafters import build_drafter, train_spec
from specblock.train.modeling import build_vocab_map
from specblock.train.optim import OptimConfig, build_optimizer
from specblock.train.distill import StrategyConfig


def timed(fn, repeats: int) -> tuple[float, float]:
    """Mean (wall seconds, process CPU seconds) per call after one warm-up call. On a shared machine the
    CPU time is the steadier measure of work (it does not count time spent waiting for a core)."""
    fn()  # warm-up
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats, (time.process_time() - cpu) / repeats


def measure(args) -> dict:
    ensure_embedded_target(args.target)
    target, _ = load_target(TargetConfig(name_or_path=args.target, dtype=args.dtype, device=args.device))
    torch.manual_seed(0)
    vocab = target.config.vocab_size
    ids = torch.randint(0, vocab, (args.batch, args.length), device=args.device)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    layers = default_feature_layers(target.config.num_hidden_layers)
    counts = torch.bincount(ids.flatten().cpu(), minlength=vocab) + torch.arange(vocab).flip(0) / vocab
    d2t = build_vocab_map(counts, args.draft_vocab)[0]
    spec = train_spec(args.drafter)
    slots = {"specblock": "block_size", "eagle3": "ttt_length"}  # what --slots sets in each drafter
    cfg = spec.config(
        draft_vocab_size=args.draft_vocab, num_feature_layers=len(layers), **{slots[args.drafter]: args.slots}
    )
    if args.layers is not None and hasattr(cfg, "num_layers"):  # drafters without the field keep their depth
        cfg = dataclasses.replace(cfg, num_layers=args.layers)
    module = build_drafter(
        args.drafter,
        cfg,
        target.config,
        target.get_input_embeddings().weight,
        target.get_output_embeddings().weight,
        d2t,
    ).to(args.device)
    head = TargetHead.of(target)
    strategy = spec.strategy(
        module, target, layers, LossConfig(), StrategyConfig(num_ttt_blocks=args.blocks), head
    )
    optimizer = build_optimizer(module, OptimConfig(lr=1e-4))
    with torch.no_grad():
        out = target(**{k: batch[k] for k in ("input_ids", "attention_mask")}, output_hidden_states=True)
        cached = {
            **batch,
            "features": concat_features(out.hidden_states, layers),
            "last_hidden": out.hidden_states[-1],
            # what a training run reads beside its feature cache (data/target_argmax.py)
            "target_argmax": head(out.hidden_states[-1], upcast=False).max(-1).indices,
        }

    def step(b):
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(args.device, dtype=torch.bfloat16, enabled=args.autocast):
            out = strategy.forward_loss(b, step=10**6, epoch=0)  # late step: every block on
            loss = strategy.loss(out.sums, out.counts)
        loss.backward()
        optimizer.step()

    def target_forward():
        with torch.no_grad():
            strategy.target_outputs(batch)

    t_target, c_target = timed(target_forward, args.repeats)
    t_offline, _ = timed(lambda: step(cached), args.repeats)
    t_online, _ = timed(lambda: step(batch), args.repeats)
    teacher = strategy.target_outputs(batch)
    strategy.target_outputs = lambda b: teacher  # the drafter's own work alone: fwd + bwd + AdamW
    t_drafter, c_drafter = timed(lambda: step(batch), args.repeats)
    tokens = args.batch * args.length
    peak = (
        torch.cuda.max_memory_allocated() / 2**30
        if args.device == "cuda"
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    )
    return {
        "drafter": args.drafter,
        "target_fwd_s": t_target,
        "drafter_s": t_drafter,
        "online_tok_s": tokens / t_online,
        "offline_tok_s": tokens / t_offline,
        "share": t_drafter / t_target,
        "cpu_share": c_drafter / c_target,
        "peak_gib": peak,
    }


def main() -> None:
    setup_logging()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=DEFAULT_TARGET_DIR)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--drafters", nargs="+", default=["specblock", "eagle3"])
    ap.add_argument("--drafter", help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--length", type=int, default=256)
    ap.add_argument("--slots", type=int, default=4, help="SpecBlock K / EAGLE-3 TTT steps")
    ap.add_argument("--blocks", type=int, default=2, help="SpecBlock multi-block TTT blocks")
    ap.add_argument(
        "--layers",
        type=int,
        default=None,
        help="decoder layers of a drafter that has the setting (SpecBlock; default: its own)",
    )
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--autocast", action="store_true", help="train the drafter under bf16 autocast")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.drafter:  # one configuration, in a child process
        print(json.dumps(measure(args)))
        return
    print(
        f"target {args.target} ({args.dtype}, {args.device}), drafter {'bf16 autocast' if args.autocast else 'fp32'}, "
        f"batch {args.batch} x {args.length} tokens, "
        f"K = {args.slots}, draft vocab {args.draft_vocab}, torch threads {torch.get_num_threads()}\n"
    )
    print(
        "| drafter | target fwd s | drafter fwd+bwd+AdamW s | drafter / target fwd | same, CPU time | online tok/s "
        "| offline tok/s | peak GiB |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name in args.drafters:
        child = [sys.executable, __file__, *sys.argv[1:], "--drafter", name]
        r = json.loads(
            subprocess.run(child, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
        )
        print(
            f"| {name} | {r['target_fwd_s']:.2f} | {r['drafter_s']:.2f} | {r['share']:.2f} | {r['cpu_share']:.2f} | "
            f"{r['online_tok_s']:.0f} | {r['offline_tok_s']:.0f} | {r['peak_gib']:.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
