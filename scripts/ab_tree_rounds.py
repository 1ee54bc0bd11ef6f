"""A/B, side by side in one process: SpecBlock's tree with budget=auto starting its second block round
from every beam leaf (the rule before session 7: `more_rounds` said only yes or no) or only from the
leaves whose blocks the budget could keep (now). bench_decode.py's interleaved runner and table: bf16,
T = 0, 1 thread, prompts interleaved, median of the repeats.

    SPECBLOCK_DATASETS=../shared/datasets python scripts/ab_tree_rounds.py [--drafter DIR] [--prompts 3]
"""

import sys


sys.path.insert(0, "scripts")
import ab_loop
from specblock.evaluate.decoding import budget

OLD = "tree@auto, every beam leaf"


class OldAuto(budget.AutoBudget):
    """The rule before: a further round expands every beam leaf whenever it expands any."""

    def more_rounds(self, scores, frontier):
        return len(frontier) if super().more_rounds(scores, frontier) else 0


def old_rule(dec):
    dec.auto.__class__ = OldAuto
    return dec


def main(argv: list[str] | None = None) -> None:
    ab_loop.ab_tree_auto(OLD, old_rule, argv)


if __name__ == "__main__":
    main()
