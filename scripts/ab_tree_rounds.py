"""A/B, side by side in one process: SpecBlock's tree with budget=auto drafting its further block rounds
by optimism alone (the rule before session 18: children as likely as their parents could pay) against now
(optimism, then the round's measured record: `AutoBudget.round_pays`), and the tree with one block round
(`trees.specblock.steps=1`). bench_decode.py's interleaved runner and table: bf16, T = 0, prompts
interleaved, median of the repeats.

    SPECBLOCK_DATASETS=../shared/datasets python scripts/ab_tree_rounds.py [--drafter DIR] [--prompts 8]
"""

import sys
from dataclasses import replace

sys.path.insert(0, "scripts")
import ab_loop
from specblock.evaluate.decoding import budget

OLD = "tree@auto, rounds by optimism alone"


class Optimistic(budget.AutoBudget):
    """The rule before: a further round is drafted whenever optimism says it could pay."""

    def round_pays(self, r, conf, tree):
        return True


def old_rule(dec):
    dec.auto.__class__ = Optimistic
    return dec


def one_round(dec):
    """The tree with one block round (the first, whose logits come with the root)."""
    dec.cfg = dec.drafts.cfg = replace(dec.cfg, tree=replace(dec.cfg.tree, steps=1))
    return dec


def main(argv: list[str] | None = None) -> None:
    ab_loop.ab_tree_auto(OLD, old_rule, argv, more={"tree@auto, one block round": one_round})


if __name__ == "__main__":
    main()
