"""Where a drafter's acceptance comes from: teacher-forced slot-0 top-1 and acceptance by answer position,
beside how often prompt lookup (a 3-gram match) would have guessed the same token.

    python scripts/acceptance_by_position.py checkpoints/cpu_full_6k-specblock/drafter \
        --heldout checkpoints/cpu_full_6k-specblock --rows 40
    python scripts/acceptance_by_position.py checkpoints/cpu_full_6k-specblock/drafter --eval --limit 3

`--heldout RUN`: the run's own held-out split (its config's data folder and `validation` settings), the
target's regenerated answers as training saw them. `--eval`: the evaluation sets' prompts (as
`specblock.evaluate` builds them), answered by the target greedily (`--max-new-tokens`): the text the
decoding loop drafts for at temperature 0, so the acceptance printed here is what the loop's chain can reach.

The drafter reads the target's float32 features over the whole text in one forward (as training does);
position t drafts from the features at t and token t+1, and slot k predicts token t+2+k (train/batching.py).
Teacher-forced acceptance counts the slots that match in a row from slot 0 (the chain's tau at T = 0).
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path

import torch

BUCKETS = ((0, 64), (64, 192), (192, None))


def lookup_hit(seq: list[int], i: int, n: int = 3) -> bool:
    """Whether prompt lookup would guess seq[i]: the latest earlier occurrence of the n tokens before i
    is followed by seq[i]."""
    if i < n:
        return False
    key = seq[i - n : i]
    for j in range(i - 1, n - 1, -1):
        if seq[j - n : j] == key:
            return seq[j] == seq[i]
    return False


def bucket(offset: int) -> str:
    for lo, hi in BUCKETS:
        if hi is None or offset < hi:
            return f"{lo}-{hi - 1}" if hi is not None else f"{lo}+"
    raise AssertionError


def score(pred: torch.Tensor, seq: list[int], answer: list[bool]) -> list[tuple[int, int, int, bool]]:
    """pred [S, K] predicted token ids (position t's slot k predicts seq[t+2+k]); answer [T] whether each
    token is the target's answer. -> one (answer offset, slot-0 hit, accepted slots, lookup hit) per
    answer token i = t+2; the accepted run stops at the first miss or the answer's end."""
    start = answer.index(True) if True in answer else len(seq)
    out = []
    for t in range(min(pred.shape[0], len(seq) - 2)):
        i = t + 2
        if not answer[i]:
            continue
        run = 0
        for k in range(pred.shape[1]):
            if i + k < len(seq) and answer[i + k] and int(pred[t, k]) == seq[i + k]:
                run += 1
            else:
                break
        out.append((i - start, int(int(pred[t, 0]) == seq[i]), run, lookup_hit(seq, i)))
    return out


def table(groups: dict[str, list[tuple[int, int, int, bool]]], label: str) -> str:
    lines = [
        f"| {label} | answer tokens | slot-0 top-1 | teacher-forced acceptance | 3-gram lookup would guess |",
        "|---|---|---|---|---|",
    ]
    for name, rows in groups.items():
        n = len(rows)
        if n:
            hit, acc, look = (sum(r[j] for r in rows) / n for j in (1, 2, 3))
            lines.append(f"| {name} | {n:,} | {hit:.3f} | {acc:.3f} | {look:.3f} |")
    return "\n".join(lines) + "\n"


def predictions(drafter, target, ids: torch.Tensor) -> torch.Tensor:
    """ids [1, T] -> predicted target ids [T-1, K] from one target forward and one drafter forward."""
    with torch.no_grad():
        feats = target(ids).features
        out = drafter(feats[:, :-1], ids[:, 1:])
    return drafter.d2t[out.logits.argmax(-1)][0]


def heldout_texts(run: Path, rows: int):
    from omegaconf import OmegaConf

    from specblock.data.shards import TokenDataset
    from specblock.train.validation import split_indices

    cfg = OmegaConf.load(run / "config.yaml")
    data = TokenDataset(Path(cfg.data.out_dir) / "tokens")
    val = cfg.validation
    _, held = split_indices(len(data), val.fraction, val.max_rows, val.seed)
    for r in held[:rows]:
        row = data[r]
        yield "held-out", row["input_ids"].long()[None], [bool(m) for m in row["loss_mask"].tolist()]


def eval_texts(drafter_dir: str, target, tokenizer, args):
    from specblock.data.evalsets import prompt_ids
    from specblock.evaluate.config import EvalConfig
    from specblock.evaluate.run import load_set

    # the sets as the evaluation app loads them (local_root auto: $SPECBLOCK_DATASETS, else the hub)
    cfg = EvalConfig(
        drafters={"specblock": drafter_dir}, methods=["tree"], limit=args.limit, on_unavailable="error"
    )
    for name in args.datasets:
        for p in load_set(cfg, name):
            ids = torch.tensor([prompt_ids(p, tokenizer)])
            with torch.no_grad():
                full = target.model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)
            yield p.dataset, full, [i >= ids.shape[1] for i in range(full.shape[1])]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("drafter", help="an exported drafter folder")
    which = ap.add_mutually_exclusive_group(required=True)
    which.add_argument("--heldout", type=Path, help="a training run folder: its held-out split")
    which.add_argument("--eval", action="store_true", help="the evaluation sets, answered by the target")
    ap.add_argument("--rows", type=int, default=40, help="held-out rows")
    ap.add_argument("--limit", type=int, default=3, help="prompts per evaluation set")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--datasets", nargs="+", default=["gsm8k", "humaneval", "mgsm", "lm1b", "alpaca"])
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from specblock.data.target import FeatureTarget, TargetConfig
    from specblock.train.export import load_drafter

    drafter, meta = load_drafter(args.drafter)
    drafter = drafter.float().eval()
    target, tokenizer = FeatureTarget.from_config(TargetConfig(dtype="float32"))
    target = FeatureTarget(target.model, meta["feature_layers"])  # the layers this drafter reads
    texts = (
        heldout_texts(args.heldout, args.rows)
        if args.heldout
        else eval_texts(args.drafter, target, tokenizer, args)
    )
    by_set, by_offset = defaultdict(list), defaultdict(list)
    for name, ids, answer in texts:
        rows = score(predictions(drafter, target, ids), ids[0].tolist(), answer)
        by_set[name] += rows
        for r in rows:
            by_offset[bucket(r[0])].append(r)
    print(table(dict(by_offset), "answer positions"))
    if len(by_set) > 1:
        by_set["all"] = [r for rows in by_set.values() for r in rows]
        print(table(dict(by_set), "set"))


if __name__ == "__main__":
    main()
