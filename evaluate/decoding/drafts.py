"""What each iteration drafts (loop.py, step 1): a chain, K i.i.d. chains, the drafter's dynamic tree (its
size chosen by the auto budget or fixed), prompt lookup's chain, or the tree with the lookup chain grafted
on; and what the auto budget's calibration needs back from it (the kept nodes' scores, the drafting
seconds it models per round or per token)."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from specblock.evaluate.decoding.budget import AutoBudget
from specblock.evaluate.decoding.drafting import Root, greedy_draft, sample_drafts
from specblock.evaluate.decoding.graft import LookupGraft
from specblock.evaluate.decoding.trees import DraftTree, drafts_tree, graft_chain
from specblock.evaluate.verify import CROSS_ITERATION
from specblock.evaluate.verify.randomness import Sampler


class Draft(NamedTuple):
    """One iteration's draft. tree: what the target verifies. For chain, iid and lookup also tokens [K, L]
    (target ids), their draft laws probs [K, L, V] float32 (a drafter's over the columns, [K, L, Vd + 1]:
    columns.py; None where nothing reads them: temperature 0, lookup at temperature 0) and nodes[k][i] =
    the tree node of draft k's first i tokens; a dynamic tree has none of the three."""

    tree: DraftTree
    tokens: Tensor | None = None
    probs: Tensor | None = None
    nodes: list[list[int]] | None = None


class Drafts:
    """Makes a decoder's drafts (`draft`). drafter: its drafting session (a LookupSession for `lookup`);
    graft: tree+lookup's LookupGraft; auto: the AutoBudget of budget=auto / draft_length=auto (else None).
    After each draft, `scores` holds the kept draft's cumulative log-probs and `variable_seconds` the
    drafting seconds the budget models per round or per token (the auto calibration reads both)."""

    def __init__(
        self, cfg, drafter, graft: LookupGraft | None, auto: AutoBudget | None, greedy: bool, vocab_size: int
    ):
        self.cfg, self.drafter, self.graft, self.auto = cfg, drafter, graft, auto
        self.greedy, self.vocab_size = greedy, vocab_size
        self.scores: list[float] = []
        self.variable_seconds = 0.0
        # draft_length=auto: a chain verified token by token (or at temperature 0) is drafted token by token
        # while one more may pay (`auto_chain`); i.i.d. drafts, a block verifier's chain when sampling and a
        # verifier whose continuation spans the block get their length before drafting (`choose_up_front`),
        # at least the `shortest` the loop passes to `draft` (the horizon of the continuation in force)
        by_token = cfg.mode == "chain" and cfg.verifier not in CROSS_ITERATION
        by_token = by_token and (greedy or cfg.verifier == "token")
        self.up_front = bool(cfg.auto_length) and not by_token

    def draft(self, root: Root | None, gen: Sampler, context: list[int], shortest: int = 1) -> Draft:
        """This iteration's draft from `root`; context: the prompt and the tokens generated so far; shortest:
        the least length an up-front draft length (`up_front`) may take."""
        cfg = self.cfg
        # tree+lookup, or a tree with budget=auto: the drafter on demand (graft.py)
        if self.graft is not None:
            chain = self.graft.chain(context)
            alone = None if self.auto is None else self.auto.lookup_alone(len(chain), self.graft.ngram)
            if alone is not None:  # the chain alone (cut to its best length) is expected to emit faster
                self.scores = []
                if not chain:  # a plain step, unless lookup's datastore has a chain
                    chain = self.graft.fallback(context)
                    alone = len(chain)
                return Draft(self.graft.chain_alone(chain[:alone]))
            return Draft(self.tree_with_lookup(self.graft.catch_up(self.drafter), chain))
        if cfg.mode == "tree":
            tree = self.drafter_tree(root)
            if self.auto is not None:
                tree = tree.pruned(self.auto.choose(tree.score[1:])).tree
                self.scores = tree.score[1:]
            return Draft(tree)
        if cfg.mode == "lookup":
            draft = self.drafter.draft(context)
            tokens = torch.tensor([draft], dtype=torch.int64).view(1, len(draft))  # [1, L'], L' <= L, maybe 0
            # the point-mass draft law: one-hot rows [1, L', V] (verify/chain.py: accept w.p. q(x))
            probs = None if self.greedy else point_mass(tokens, self.vocab_size)
            return chain_draft(tokens, probs)
        if cfg.auto_length and not self.up_front:
            return self.auto_chain(root, gen)
        k, length, spent = cfg.num_drafts, cfg.draft_length, self.drafter.cost.seconds
        if self.up_front:  # from past iterations only: the drafts below are verified as fixed-length ones
            length = self.auto.choose_up_front(k, cfg.draft_length, shortest)
        if self.greedy:  # identical argmax drafts: the chain once, copied; greedy_path reads no draft law
            tokens, probs = greedy_draft(root, length).expand(k, -1), None
        else:
            tokens, probs = sample_drafts(root, k, length, gen)
        if self.up_front:
            self.scores, self.variable_seconds = [], self.drafter.cost.seconds - spent  # modelled per depth
            self.auto.observe_drafting(length, self.variable_seconds)
        return chain_draft(tokens, probs)

    def drafter_tree(self, root: Root, extra: list[float] = ()) -> DraftTree:
        """The drafter's dynamic tree at `root`, not yet cut to a budget. With budget=auto each further round
        is drafted only if it can pay (budget.py), counting nodes of scores `extra` as already in the tree."""
        cfg = self.cfg
        if self.auto is None:
            return root.session.tree(root, cfg.tree)
        calls, seconds = self.drafter.cost.calls, self.drafter.cost.seconds
        auto = self.auto
        auto.tree_rounds = 0  # counted by more_rounds, read back after the verification (loop.py)
        more = (
            (lambda scores, frontier: auto.more_rounds(scores + extra, frontier))
            if extra
            else auto.more_rounds
        )
        tree = root.session.tree(root, cfg.tree, more)
        self.variable_seconds = self.drafter.cost.seconds - seconds  # modelled per round
        self.auto.observe_rounds(self.drafter.cost.calls - calls, self.variable_seconds)
        return tree

    def tree_with_lookup(self, root: Root, chain: list[int]) -> DraftTree:
        """tree+lookup: the drafter's tree with the lookup chain grafted under the root. With a fixed budget
        the chain is added to the drafter's pruned tree. With budget=auto its tokens compete with the
        drafter's nodes for the budget: the i-th has the measured rate at which lookup tokens at depth i
        were accepted as its confidence (`AutoBudget.lookup_confidences`), it counts when the drafter's
        rounds are weighed, and the union is cut to the best B nodes; the drafter's calibration c sees only
        the drafter's own nodes (their own scores, even where the chain shares them)."""
        graft = self.graft
        if self.auto is None:
            tree = self.drafter_tree(root)
            graft.drafter_nodes = set(range(1, len(tree)))
            graft.lookup_nodes = graft_chain(tree, chain)
            return tree
        c = self.auto.c  # choose_budget weighs every confidence by c: the chain's are divided by it first
        extra = [math.log(a / c) for a in self.auto.lookup_confidences(len(chain), graft.ngram)]
        tree = self.drafter_tree(root, extra)
        drafted, own = len(tree), list(tree.score)
        chain_nodes = graft_chain(tree, chain, extra)
        kept = tree.pruned(self.auto.choose(tree.score[1:]))
        new_of = {o: n for n, o in enumerate(kept.old)}
        graft.drafter_nodes = {new_of[o] for o in kept.old[1:] if o < drafted}
        self.scores = [own[o] for o in kept.old[1:] if o < drafted]
        graft.lookup_nodes = []
        for o in chain_nodes:  # the kept part of the chain (a prefix: its scores never increase)
            if o not in new_of:
                break
            graft.lookup_nodes.append(new_of[o])
        return kept.tree

    def auto_chain(self, root: Root, gen: Sampler) -> Draft:
        """draft_length=auto (budget.py): draft token by token while one more could raise the modelled
        rate. At temperature 0 the chain is then cut to its best length; at temperature > 0 it is not, as
        cutting after seeing a token would make keeping it depend on its value (and its verification
        biased), while stopping depends on the tokens before only."""
        y, rows, confidences, spent = (), [], [], self.drafter.cost.seconds
        while len(y) < self.cfg.draft_length:
            if self.greedy:  # the argmax, with its softmax probability as the confidence
                probs = torch.softmax(root.logits([y])[0].float(), dim=-1)
                index = int(probs.argmax())
                token, p = int(root.session.d2t[index]), float(probs[index])
            else:
                law = root.law(y)  # over the columns (columns.py)
                col = int(gen.categorical(law))
                token, p = root.session.ids[col], float(law[col])
                rows.append(law)
            y += (token,)
            confidences.append(p * (confidences[-1] if confidences else 1.0))
            if not self.auto.draft_more(confidences):
                break
        self.variable_seconds = self.drafter.cost.seconds - spent  # modelled per token, not as fixed
        self.auto.observe_drafting(len(y), self.variable_seconds)
        if may_cut_drafted_chain(self.greedy):
            n = self.auto.choose_length(confidences)
        else:
            n = len(y)
            self.auto.chosen.append(n)
        self.scores = [math.log(max(a, 1e-300)) for a in confidences[:n]]
        probs = torch.stack(rows[:n])[None] if rows else None
        return chain_draft(torch.tensor([y[:n]], dtype=torch.int64), probs)


def chain_draft(tokens: Tensor, probs: Tensor | None) -> Draft:
    """The draft of K chains tokens [K, L] (target ids) with their draft laws probs [K, L, V] or None."""
    tree, nodes = drafts_tree(tokens.tolist())
    return Draft(tree, tokens, probs, nodes)


def may_cut_drafted_chain(greedy: bool) -> bool:
    """Whether an auto-length chain may be cut back after drafting: only at temperature 0. When sampling,
    keeping a drafted token must not depend on its value, or its verification is biased
    (tests/evaluate/test_auto_sizes.py::test_exact_law_of_auto_draft_length shows it)."""
    return greedy


def point_mass(tokens: Tensor, vocab_size: int) -> Tensor:
    """tokens [K, L] -> one-hot draft laws [K, L, V] float32 (a deterministic draft's law)."""
    return torch.nn.functional.one_hot(tokens, vocab_size).to(torch.float32)
