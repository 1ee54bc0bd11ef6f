"""A training corpus that mixes regenerated ShareGPT rows (the committed 2k set's by default) with questions of
GSM8K's TRAIN split (never the test split the evaluation reads), spread evenly, so that a feature cache of the
first N rows (the quick recipe's `data.features.max_rows`) holds the same share. It seeds the
data folder with the ShareGPT rows' finished answers, so the data stage regenerates only the math questions.

The data config does the same since session 46 (`data.mix` and `data.regenerate.reuse`, README "Stage 1";
`data=mix_6k_gsm8k`, `experiment=cpu_full_6k_mix`). This script stays because sessions 45-46's measured runs
were built with it: it takes every row of a regenerated.jsonl (the 6k file holds 7,097, the 2k set's seeded
rows included, where the 6k recipe draws 6,315) and shuffles GSM8K with `random.shuffle`, where the config
draws both corpora with `subsample`, so their rows differ.

    SPECBLOCK_DATASETS=../shared/datasets python scripts/mix_corpus.py --out checkpoints/data/mix-sg630-gsm210
    python -m specblock.train experiment=quick drafter=specblock run_name=quick_mix-specblock \\
      data.run_name=mix-sg630-gsm210 data.out_dir=checkpoints/data/mix-sg630-gsm210 \\
      data.corpus.source=checkpoints/data/mix-sg630-gsm210/corpus.jsonl data.corpus.limit=null
    # the cpu_full scale: every row of the 6k set and 1,000 questions (~12 %), then cpu_full_6k_cut's recipe
    python scripts/mix_corpus.py --out checkpoints/data/mix-6k-gsm1000 --sharegpt-rows 7097 --gsm8k-rows 1000 \
      --sharegpt checkpoints/data/smollm2-sharegpt-regen-6k/regenerated.jsonl
    python -m specblock.train experiment=cpu_full_6k_cut run_name=cpu_full_6k_mix-specblock resume=latest \
      data.run_name=mix-6k-gsm1000 data.out_dir=checkpoints/data/mix-6k-gsm1000 \
      data.corpus.source=checkpoints/data/mix-6k-gsm1000/corpus.jsonl data.corpus.limit=null \
      data.features.cut_repeats=32   # the capture cut as training cuts: about half the tokens

Writes OUT/corpus.jsonl (messages format: {"id", "messages"}; the GSM8K rows' reference answers are there
only as the format's assistant turn, the data stage answers them again) and OUT/regenerated.jsonl (the
ShareGPT rows as their regeneration left them; an existing file is refused). Session 45 measured it
against the quick recipe (README "The main job, measured").
"""

from __future__ import annotations

import argparse
import json
import os
import random
from pathlib import Path

from specblock.data.corpora import CorpusConfig, interleave, load_conversations
from specblock.data.io import atomic_path
from specblock.data.regenerate import jsonl_line

REGEN_2K = Path("checkpoints/data/smollm2-sharegpt-regen-2k/regenerated.jsonl")


def gsm8k_rows(path: Path, count: int, seed: int) -> list[dict]:
    """`count` GSM8K rows ({question, answer} json lines, read as the data stage reads the `qa` format: a bad
    row raises BadInputError naming file, row and field) in a seeded shuffle, as messages rows."""
    conversations = load_conversations(CorpusConfig(source=str(path), format="qa"))
    if count > len(conversations):
        raise SystemExit(f"{path}: {count} questions asked, the file holds {len(conversations)}")
    random.Random(seed).shuffle(conversations)
    return [
        {"id": f"gsm8k-train-{i}", "messages": turns} for i, (_, turns) in enumerate(conversations[:count])
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="the data folder (the run's data.out_dir)")
    ap.add_argument(
        "--sharegpt", type=Path, default=REGEN_2K,
        help="a regenerated.jsonl of ShareGPT rows (default: the committed 2k set's; the 6k set's for cpu_full)",
    )  # fmt: skip
    ap.add_argument("--sharegpt-rows", type=int, default=630, help="its first rows, in file order")
    ap.add_argument("--gsm8k-rows", type=int, default=210)
    local = os.environ.get("SPECBLOCK_DATASETS")
    ap.add_argument(
        "--gsm8k", type=Path, default=Path(local) / "gsm8k" / "train.jsonl" if local else None,
        help="GSM8K's train split as json lines (default: $SPECBLOCK_DATASETS/gsm8k/train.jsonl)",
    )  # fmt: skip
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.gsm8k is None or not args.gsm8k.is_file():
        raise SystemExit(f"GSM8K's train split not found at {args.gsm8k} (set --gsm8k or SPECBLOCK_DATASETS)")
    with open(args.sharegpt, encoding="utf-8") as f:
        sharegpt = [json.loads(line) for line in f][: args.sharegpt_rows]
    if len(sharegpt) < args.sharegpt_rows:
        raise SystemExit(f"{args.sharegpt}: {args.sharegpt_rows} rows asked, it holds {len(sharegpt)}")
    rows = interleave(
        [{"id": r["id"], "messages": r["turns"]} for r in sharegpt],
        gsm8k_rows(args.gsm8k, args.gsm8k_rows, args.seed),
    )
    args.out.mkdir(parents=True, exist_ok=True)
    seeded = args.out / "regenerated.jsonl"
    if seeded.exists():
        raise SystemExit(f"{seeded} exists: this folder was made already (remove it to start again)")
    # corpus.jsonl first: regenerated.jsonl, renamed into place last, is what marks the folder made
    with atomic_path(args.out / "corpus.jsonl") as tmp:
        tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    with atomic_path(seeded) as tmp:
        tmp.write_text("".join(jsonl_line(r["id"], r["turns"]) for r in sharegpt), encoding="utf-8")
    print(f"{args.out}: {len(rows)} rows ({len(sharegpt)} ShareGPT, {args.gsm8k_rows} GSM8K train)")


if __name__ == "__main__":
    main()
