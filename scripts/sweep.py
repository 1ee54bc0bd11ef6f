"""Run a grid of training (or evaluation) jobs, one `accelerate launch` per job.

Hydra's --multirun inside `accelerate launch` would run the whole sweep on every rank, each rank
resolving its own run directory; so sweeps are driven from outside: every job gets one run_name,
computed here once and passed to all its ranks.

    python scripts/sweep.py --config configs/accelerate/zero2.yaml -- experiment=debug \\
        loss.slot_decay=0.7,0.8 drafter.block_size=3,4
    python scripts/sweep.py --no-accelerate -- experiment=debug drafter=specblock,eagle3   # one process
Add --dry-run to print the commands.
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import subprocess
import sys


def expand(overrides: list[str]) -> list[list[str]]:
    """key=a,b plus k2=c -> [[key=a, k2=c], [key=b, k2=c]] (lists in brackets are left alone)."""
    axes = []
    for item in overrides:
        key, _, value = item.partition("=")
        values = [value] if value.startswith("[") else value.split(",")
        axes.append([f"{key}={v}" for v in values])
    return [list(combo) for combo in itertools.product(*axes)]


def job_name(prefix: str, job: list[str], swept: set[str]) -> str:
    parts = [o for o in job if o.split("=")[0] in swept]
    return re.sub(r"[^A-Za-z0-9_.=-]+", "_", "-".join([prefix, *parts]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/accelerate/zero2.yaml", help="accelerate config file")
    ap.add_argument("--module", default="specblock.train")
    ap.add_argument("--prefix", default="sweep")
    ap.add_argument("--no-accelerate", action="store_true", help="plain python, one process per job")
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    swept = {o.split("=")[0] for o in args.overrides if "," in o.partition("=")[2]}
    jobs = expand(args.overrides)
    for i, job in enumerate(jobs):
        name = job_name(args.prefix, job, swept)
        launcher = (
            [sys.executable, "-m"]
            if args.no_accelerate
            else ["accelerate", "launch", "--config_file", args.config, "-m"]
        )
        cmd = [*launcher, args.module, *job, f"run_name={name}"]
        print(f"[{i + 1}/{len(jobs)}] {' '.join(cmd)}", flush=True)
        if not args.dry_run:
            subprocess.run(cmd, check=True, env=os.environ.copy())


if __name__ == "__main__":
    main()
