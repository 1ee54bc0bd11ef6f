"""Time per verification call for every verifier, printed as a Markdown table.

    python scripts/bench_verify.py                 # V in {49152, 128256}, K in {1,2,4,8}, L in {4,8}
    python scripts/bench_verify.py --quick         # one V, fewer repeats
    python scripts/bench_verify.py --device cuda   # on a GPU

Inputs are synthetic (make_inputs says how; the per-token acceptance sum_x min(p, q) is reported);
laws depend on the depth only, so that drafts sharing a prefix share their conditionals, as the
verifiers assume.
Drafts are sampled i.i.d. from the draft law. Probabilities are float32, as a model produces them; the
conversion to float64 is part of each verifier's time. The reference for the 5 % budget is a forward of
SmolLM2-135M's shape (random weights, no download) over K x (L+1) tokens.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

import torch

from specblock.data.logs import setup_logging
from specblock.evaluate.verify import SINGLE_DRAFT, VERIFIERS, get_verifier

log = logging.getLogger(__name__)

ORDER = [
    "token",
    "block",
    "greedy_block",
    "spectr",
    "rrs",
    "spectr_gbv",
    "greedy",
]  # then any other registered


def make_inputs(k: int, n: int, vocab: int, gen: torch.Generator, device: str, temperature: float = 1.0):
    """target_probs [K, L+1, V], draft_probs [K, L, V] (float32), draft_tokens [K, L], acceptance.

    Logits z = 2 N(0, 1) plus a boost U(0, 14) on one random token per position, so the target's top-1
    probability spans ~0 to ~1 as an LLM's does; the draft sees z + N(0, 1) and shares the boost.
    """
    z = 2.0 * torch.randn(n + 1, vocab, generator=gen)
    top = torch.randint(0, vocab, (n + 1,), generator=gen)
    z[torch.arange(n + 1), top] += 14.0 * torch.rand(n + 1, generator=gen)
    q = torch.softmax(z / temperature, -1)
    p = torch.softmax((z[:n] + torch.randn(n, vocab, generator=gen)) / temperature, -1)
    tokens = torch.stack([torch.multinomial(p, 1, generator=gen).squeeze(-1) for _ in range(k)])
    accept = float(torch.minimum(p, q[:n]).sum(-1).mean())
    tp = q.expand(k, n + 1, vocab).contiguous().to(device)
    dp = p.expand(k, n, vocab).contiguous().to(device)
    return tp, dp, tokens.to(device), accept


def time_call(fn, repeats: int, device: str) -> float:
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def forward_time(tokens: int, device: str, repeats: int) -> float:
    """Median time of a SmolLM2-135M-shaped forward (random weights) over `tokens` tokens."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(cfg).to(device).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, tokens), device=device)
    with torch.inference_mode():
        model(ids)
        return time_call(lambda: model(ids), repeats, device)


def main(argv: list[str] | None = None) -> None:
    setup_logging()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, nargs="+", default=[49152, 128256])
    ap.add_argument("--drafts", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--lengths", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--quick", action="store_true", help="V = 49152, K in {1, 4}, L = 4, 5 repeats")
    args = ap.parse_args(argv)
    if args.quick:
        args.vocab, args.drafts, args.lengths, args.repeats = [49152], [1, 4], [4], 5
    gen = torch.Generator().manual_seed(0)
    log.info(f"device={args.device} torch={torch.__version__} threads={torch.get_num_threads()}\n")
    log.info("| V | K | L | accept/token | verifier | ms/call | x spectr | % of target fwd |")
    log.info("|---|---|---|---|---|---|---|---|")
    for vocab in args.vocab:
        for k in args.drafts:
            for n in args.lengths:
                fwd = forward_time(k * (n + 1), args.device, max(3, args.repeats // 4))
                inputs = [
                    make_inputs(k, n, vocab, gen, args.device, args.temperature) for _ in range(args.repeats)
                ]
                acc = statistics.mean(i[3] for i in inputs)
                ms = {}
                for name in sorted(
                    VERIFIERS, key=lambda v: (ORDER.index(v) if v in ORDER else len(ORDER), v)
                ):
                    kk = 1 if name in SINGLE_DRAFT else k
                    if name in SINGLE_DRAFT and k > 1:
                        continue
                    fn, it = get_verifier(name), iter(inputs * 2)

                    def call(fn=fn, it=it, kk=kk):
                        tp, dp, x, _ = next(it)
                        fn(tp[:kk], dp[:kk], x[:kk], gen if args.device == "cpu" else None)

                    call()  # warm-up
                    ms[name] = 1e3 * time_call(call, args.repeats, args.device)
                for name, t in ms.items():
                    ratio = f"{t / ms['spectr']:.2f}" if "spectr" in ms else "-"
                    log.info(
                        f"| {vocab} | {k} | {n} | {acc:.2f} | {name} | {t:.2f} | {ratio} | {100 * t / (1e3 * fwd):.1f} |"
                    )
                log.info(
                    f"| {vocab} | {k} | {n} | | target forward, {k * (n + 1)} tokens | {1e3 * fwd:.1f} | | |"
                )


if __name__ == "__main__":
    main()
