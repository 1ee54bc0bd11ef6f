"""Does a static KV cache or torch.compile pay for plain decoding on this machine? (issue 12)

    python scripts/bench_compile.py --threads 1 --dtype float32 bfloat16

Greedy decoding of SmolLM2 (the bare HF model, the LM head at the last position only) after a
`--context`-token prompt, `--new` tokens, per variant, interleaved, median of `--repeats`:
- dynamic: a DynamicCache, eager (what the decoding loop and its autoregressive baseline use);
- static: a StaticCache of prompt + new tokens, eager;
- static+compile: the same with the forward compiled by torch.compile (inductor; no CUDA graphs on a
  CPU); the first call's compile time is reported apart and not timed.
Prints a Markdown table of ms per token and the ratio to `dynamic`.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import DynamicCache, StaticCache

from specblock.data.target import DEFAULT_TARGET_DIR, DTYPES, TargetConfig, load_target


def decode(model, prompt: torch.Tensor, new: int, cache, forward) -> tuple[list[int], float]:
    """Greedy decoding; returns the tokens and the seconds of the `new - 1` one-token steps."""
    n = prompt.shape[1]
    with torch.no_grad():
        out = forward(prompt, cache, torch.arange(n))
        tokens = [int(out.logits[0, -1].argmax())]
        start = time.perf_counter()
        for i in range(new - 1):
            ids = torch.tensor([[tokens[-1]]])
            out = forward(ids, cache, torch.tensor([n + i]))
            tokens.append(int(out.logits[0, -1].argmax()))
    return tokens, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=DEFAULT_TARGET_DIR)
    ap.add_argument("--dtype", nargs="+", default=["float32"], choices=sorted(DTYPES))
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    prompt = torch.randint(100, 20000, (1, args.context), generator=torch.Generator().manual_seed(0))
    rows = []
    for dtype in args.dtype:
        model = load_target(TargetConfig(name_or_path=args.target, dtype=dtype))[0].eval()

        def eager(ids, cache, pos, model=model):
            return model(input_ids=ids, past_key_values=cache, cache_position=pos, logits_to_keep=1)

        compiled = torch.compile(eager, dynamic=False)
        length = args.context + args.new

        def static():
            return StaticCache(config=model.config, max_cache_len=length)

        variants = {
            "dynamic": (eager, DynamicCache),
            "static": (eager, static),
            "static+compile": (compiled, static),
        }
        t0 = time.perf_counter()
        decode(model, prompt, 3, static(), compiled)  # compile the prefill and the one-token step
        compile_s = time.perf_counter() - t0
        times: dict[str, list[float]] = {v: [] for v in variants}
        reference = None
        for _ in range(args.repeats):
            for name, (fwd, make_cache) in variants.items():
                tokens, seconds = decode(model, prompt, args.new, make_cache(), fwd)
                reference = reference or tokens
                if tokens != reference:
                    print(f"note: {dtype} {name} decoded other tokens than dynamic")
                times[name].append(seconds * 1e3 / (args.new - 1))
        base = statistics.median(times["dynamic"])
        for name in variants:
            ms = statistics.median(times[name])
            extra = f" (compile: {compile_s:.0f} s)" if "compile" in name else ""
            rows.append(f"| {dtype} | {name}{extra} | {ms:.1f} | {base / ms:.2f}x |")
    print(
        f"\nSmolLM2 greedy decoding, {args.context}-token context, {args.new} new tokens, median of {args.repeats}"
    )
    print("| dtype | variant | ms / token | x dynamic |\n|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
