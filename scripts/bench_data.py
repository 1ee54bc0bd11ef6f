"""Data-stage throughput for a real target: regeneration (generated tokens/s) and feature capture
(tokens/s through the target forward), printed as a Markdown table.

    python scripts/bench_data.py                       # SmolLM2-135M-Instruct (converted on first use)
    python scripts/bench_data.py --prompts 16 --batch-size 8 --max-new-tokens 64 --dtype float32
    python scripts/bench_data.py --dtype float32 --layout row packed   # weight layouts side by side

With several --layout values each gets its own copy of the target and the copies take turns batch by batch
(and forward by forward in the capture), so that a load spike on a shared machine hits all of them.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from specblock.data.corpora import CorpusConfig, load_conversations
from specblock.data.errors import RowPolicy
from specblock.data.hardware import WEIGHT_LAYOUTS, alternating_ms, resolve_layout, set_weight_layout
from specblock.data.logs import setup_logging
from specblock.data.regenerate import RegenerateConfig, fitting_prompts, generate_batch, user_rounds
from specblock.data.target import DEFAULT_TARGET_DIR, FeatureTarget, TargetConfig, load_target
from specblock.data.embedded import ensure_embedded_target
from specblock.data.templates import render_with_mask


def main() -> None:
    setup_logging()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=DEFAULT_TARGET_DIR)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument(
        "--attn", default=None, help="transformers attention kernel (sdpa, eager); default: its own"
    )
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--capture-length", type=int, default=256, help="tokens per row in the capture batch")
    ap.add_argument(
        "--layout", nargs="+", default=["auto"], choices=["auto", *WEIGHT_LAYOUTS],
        help="the target's linear layers (data/hardware.py; regenerate.weight_layout); several: side by side",
    )  # fmt: skip
    args = ap.parse_args()
    ensure_embedded_target(args.target)
    t0 = time.perf_counter()
    model, tok = load_target(
        TargetConfig(name_or_path=args.target, dtype=args.dtype, attn_implementation=args.attn)
    )
    load_s = time.perf_counter() - t0
    cfg = RegenerateConfig(
        max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, max_prompt_tokens=256
    )
    corpus = CorpusConfig(limit=4 * args.prompts, seed=1, on_bad_row="skip")
    convs = fitting_prompts(tok, load_conversations(corpus, RowPolicy("skip")), cfg, RowPolicy("skip"))
    prompts = [sum(user_rounds(turns, 1), []) for _, turns in convs[: args.prompts]]

    layouts = list(dict.fromkeys(resolve_layout(x, str(model.device)) for x in args.layout))
    models = {layout: model if i == 0 else copy.deepcopy(model) for i, layout in enumerate(layouts)}
    for layout, m in models.items():
        set_weight_layout(m, layout)

    generated, regen_s = dict.fromkeys(layouts, 0), dict.fromkeys(layouts, 0.0)
    for start in range(0, len(prompts), args.batch_size):
        for layout, m in models.items():
            t0 = time.perf_counter()
            answers = generate_batch(m, tok, prompts[start : start + args.batch_size], cfg, seed=start)
            regen_s[layout] += time.perf_counter() - t0
            generated[layout] += sum(len(tok(a, add_special_tokens=False)["input_ids"]) + 1 for a in answers)

    rows = [
        render_with_mask(tok, p + [{"role": "assistant", "content": "ok"}], args.capture_length)[0]
        for p in prompts
    ]
    ids = torch.full((args.batch_size, args.capture_length), tok.pad_token_id or 0)
    for i, r in enumerate(rows[: args.batch_size]):
        ids[i, : len(r)] = torch.tensor(r)
    targets = {layout: FeatureTarget(m) for layout, m in models.items()}
    cap_ms = alternating_ms({layout: (lambda t=t: t(ids)) for layout, t in targets.items()}, rounds=3)
    print(
        f"target {args.target} ({args.dtype}), torch threads {torch.get_num_threads()}, load {load_s:.1f} s\n"
    )
    print("| stage | weight layout | batch | tokens | seconds | tokens/s |")
    print("|---|---|---|---|---|---|")
    for layout in layouts:
        g, s = generated[layout], regen_s[layout]
        print(
            f"| regeneration (greedy, max {args.max_new_tokens} new) | {layout} | {args.batch_size} | {g} | "
            f"{s:.1f} | {g / s:.1f} |"
        )
    for layout in layouts:
        s = statistics.median(cap_ms[layout]) / 1e3
        print(
            f"| feature capture (forward, {args.capture_length} tok/row) | {layout} | {args.batch_size} | "
            f"{ids.numel()} | {s:.2f} | {ids.numel() / s:.0f} |"
        )


if __name__ == "__main__":
    main()
