"""A/B, side by side in one process: SpecBlock's tree with budget=auto starting its second block round
from every beam leaf (the rule before session 7: `more_rounds` said only yes or no) or only from the
leaves whose blocks the budget could keep (now). bench_decode.py's interleaved runner and table: bf16,
T = 0, 1 thread, prompts interleaved, median of the repeats.

    SPECBLOCK_DATASETS=../shared/datasets python scripts/ab_tree_rounds.py [--drafter DIR] [--prompts 3]
"""

import sys

import torch

sys.path.insert(0, "scripts")
import bench_decode as bd
from specblock.data.logs import setup_logging
from specblock.data.target import TargetConfig, load_target
from specblock.evaluate.decoding import budget

OLD = "tree@auto, every beam leaf"


class OldAuto(budget.AutoBudget):
    """The rule before: a further round expands every beam leaf whenever it expands any."""

    def more_rounds(self, scores, frontier):
        return len(frontier) if super().more_rounds(scores, frontier) else 0


def main(argv: list[str] | None = None) -> None:
    setup_logging()
    defaults = [
        "--methods",
        "autoregressive",
        "tree@auto",
        "--drafter",
        "checkpoints/cpu_full-specblock/drafter",
    ]
    defaults += ["--dataset", "gsm8k", "--max-new-tokens", "64", "--repeats", "2", "--threads", "1"]
    args = bd.parse_args([*defaults, *(sys.argv[1:] if argv is None else argv), "--dtype", "bfloat16"])
    torch.set_num_threads(args.threads)
    model, tok = load_target(TargetConfig(name_or_path=args.target, dtype="bfloat16"))
    prompts, eos = bd.load_prompts(args, tok), bd.eos_ids(tok, model)
    decs = bd.decoders(args, model, eos)
    decs[OLD] = bd.decoders(args, model, eos)["tree@auto"]
    decs[OLD].auto.__class__ = OldAuto
    print(bd.decoding_table(bd.interleave({"bfloat16": decs}, args, prompts), args.temperature))


if __name__ == "__main__":
    main()
