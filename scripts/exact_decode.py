"""Exact expected target calls to emit H tokens, for every verifier, on small random table models.

    python scripts/exact_decode.py                       # the BV paper's toy + 4 random instances
    python scripts/exact_decode.py --vocab 4 --length 2 --horizon 5 --instances 6

This decides which verifier is faster over whole decodes: the greedy methods' first-iteration gain can
be paid back in later iterations, which must verify against their continuation law. Every row is
exact (no sampling); the decode law is also checked against the target law.
"""

from __future__ import annotations

import argparse
import logging

from specblock.data.logs import setup_logging
from specblock.evaluate.verify import SINGLE_DRAFT, get_verifier
from specblock.evaluate.verify.exact import (
    TableModel,
    decode_law,
    expected_accepted,
    iteration_outcomes,
    law_error,
)

log = logging.getLogger(__name__)

METHODS = ["token", "block", "greedy_block", "spectr", "rrs", "spectr_gbv"]


def instance_rows(name: str, target, draft, drafts: list[int], length: int, horizon: int) -> list[str]:
    rows = []
    for k in drafts:
        for method in METHODS:
            if method in SINGLE_DRAFT and k > 1:
                continue
            verifier = get_verifier(method)
            tau = expected_accepted(iteration_outcomes(verifier, target, draft, k, length))
            result = decode_law(verifier, target, draft, k, length, horizon)
            err = law_error(result.law, target, horizon)
            rows.append(
                f"| {name} | {k} | {method} | {tau:.4f} | {result.target_calls:.4f} | "
                f"{result.tokens_per_call:.4f} | {err:.1e} |"
            )
    return rows


def main(argv: list[str] | None = None) -> None:
    setup_logging()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=4)
    ap.add_argument("--length", type=int, default=2, help="draft length L")
    ap.add_argument("--drafts", type=int, nargs="+", default=[1, 2], help="numbers of drafts K")
    ap.add_argument("--horizon", type=int, default=4, help="tokens H to emit")
    ap.add_argument("--instances", type=int, default=2)
    ap.add_argument("--alpha", type=float, default=0.6, help="Dirichlet concentration of the random laws")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    log.info(
        f"random instances: L = {args.length}, H = {args.horizon}; E[tau] is the first iteration's, calls are over whole decodes\n"
    )
    log.info(
        "| instance | K | verifier | first-iteration E[tau] | E[target calls] | tokens/call | law error |"
    )
    log.info("|---|---|---|---|---|---|---|")
    toy_q, toy_p = TableModel(2, fixed=[2 / 3, 1 / 3]), TableModel(2, fixed=[1 / 3, 2 / 3])
    for row in instance_rows("BV toy (V=2, L=2, H=7)", toy_q, toy_p, [1], 2, 7):
        log.info(row)
    for i in range(args.instances):
        seed = args.seed + i
        target = TableModel(args.vocab, seed=seed, alpha=args.alpha)
        draft = TableModel(args.vocab, seed=10_000 + seed, alpha=args.alpha)
        for row in instance_rows(
            f"random {seed} (V={args.vocab})", target, draft, args.drafts, args.length, args.horizon
        ):
            log.info(row)


if __name__ == "__main__":
    main()
