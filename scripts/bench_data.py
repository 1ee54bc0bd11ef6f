"""Data-stage throughput for a real target: regeneration (generated tokens/s) and feature capture
(tokens/s through the target forward), printed as a Markdown table.

    python scripts/bench_data.py                       # SmolLM2-135M-Instruct (converted on first use)
    python scripts/bench_data.py --prompts 16 --batch-size 8 --max-new-tokens 64 --dtype float32
"""

from __future__ import annotations

import argparse
import time

import torch

from specblock.data.corpora import CorpusConfig, load_conversations
from specblock.data.errors import RowPolicy
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

    generated, t0 = 0, time.perf_counter()
    for start in range(0, len(prompts), args.batch_size):
        answers = generate_batch(model, tok, prompts[start : start + args.batch_size], cfg, seed=start)
        generated += sum(len(tok(a, add_special_tokens=False)["input_ids"]) + 1 for a in answers)
    regen_s = time.perf_counter() - t0

    target = FeatureTarget(model)
    rows = [
        render_with_mask(tok, p + [{"role": "assistant", "content": "ok"}], args.capture_length)[0]
        for p in prompts
    ]
    ids = torch.full((args.batch_size, args.capture_length), tok.pad_token_id or 0)
    for i, r in enumerate(rows[: args.batch_size]):
        ids[i, : len(r)] = torch.tensor(r)
    target(ids)  # warm-up
    t0 = time.perf_counter()
    target(ids)
    cap_s = time.perf_counter() - t0
    print(
        f"target {args.target} ({args.dtype}), torch threads {torch.get_num_threads()}, load {load_s:.1f} s\n"
    )
    print("| stage | batch | tokens | seconds | tokens/s |")
    print("|---|---|---|---|---|")
    print(
        f"| regeneration (greedy, max {args.max_new_tokens} new) | {args.batch_size} | {generated} | {regen_s:.1f} | {generated / regen_s:.1f} |"
    )
    print(
        f"| feature capture (forward, {args.capture_length} tok/row) | {args.batch_size} | {ids.numel()} | {cap_s:.2f} | {ids.numel() / cap_s:.0f} |"
    )


if __name__ == "__main__":
    main()
