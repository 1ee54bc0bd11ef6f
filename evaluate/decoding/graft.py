"""tree+lookup's state in one decoder (loop.py): prompt lookup's chain grafted on the drafter's tree. A `tree`
with budget=auto uses the same state without chains (`chains=False`), for the drafter on demand: the auto
budget's gate (budget.py, `AutoBudget.lookup_alone`) takes a plain target step where the drafter does not pay.

- The chain: prompt lookup's draft (lookup.py) after the context, and the n-gram length it followed.
- The drafter on demand: verified positions wait in `pending` until an iteration wants the drafter's
  tree; `catch_up` then appends them all in one call.
- Who drafted what: this iteration's nodes the drafter drafted and the chain's node per depth, read after
  the verification to count each side's accepted nodes (a node both drafted counts for both).
"""

from __future__ import annotations

import torch
from torch import Tensor

from specblock.evaluate.decoding.budget import AutoBudget
from specblock.evaluate.decoding.drafting import DrafterSession, Root
from specblock.evaluate.decoding.lookup import LookupConfig, LookupSession
from specblock.evaluate.decoding.trees import DraftTree, graft_chain


class LookupGraft:
    """One decoder's tree+lookup state (module docstring); `start` resets it for each generation."""

    def __init__(self, cfg: LookupConfig, length: int, chains: bool = True):
        self.lookup = LookupSession(cfg, length)
        self.chains = chains  # False: no lookup chain is ever offered (a `tree` with budget=auto)
        self.offered = 0  # the length of this iteration's chain before any cut
        self.pending: list[tuple[Tensor, Tensor, int]] = []  # (features, tokens after, first position)
        self.drafter_nodes: set[int] = set()  # this iteration's nodes the drafter drafted
        self.lookup_nodes: list[int] = []  # this iteration's lookup chain, node per depth
        self.used_drafter = False  # whether this iteration ran the drafter
        self.ngram = 0  # what this iteration's chain followed: n, -n (a datastore n-gram), 0 (no match)

    def start(self, features: Tensor, after: Tensor) -> None:
        """A new generation: the prompt's positions wait for the first iteration that wants the drafter."""
        self.lookup.reset()
        self.pending = [(features, after, 0)]

    def chain(self, context: list[int]) -> list[int]:
        """Prompt lookup's chain after `context` (the prompt and every generated token), the context's own
        match only: the datastore's is a `fallback`."""
        chain = self.lookup.draft(context, datastore=False) if self.chains else []
        self.ngram = self.lookup.matched if self.chains else 0
        self.offered = len(chain)
        return chain

    def fallback(self, context: list[int]) -> list[int]:
        """Where this iteration would be a plain target step (no context match, the drafter not worth its
        call): lookup's datastore chain instead ([] without one). Beside the drafter the datastore's chains
        are not offered: measured with a GSM8K drafter, they led the gate to wider trees that cost more than
        they gained (README "Lookup's datastore")."""
        chain = self.lookup.datastore_draft(context) if self.chains else []
        if chain:
            self.ngram, self.offered = self.lookup.matched, len(chain)
        return chain

    def chain_alone(self, chain: list[int]) -> DraftTree:
        """This iteration's tree without the drafter: the chain under the root."""
        tree = DraftTree()
        self.used_drafter, self.drafter_nodes = False, set()
        self.lookup_nodes = graft_chain(tree, chain)
        return tree

    def catch_up(self, session: DrafterSession) -> Root:
        """The drafter appends every verified position it has not seen, in one call."""
        features = torch.cat([f for f, _, _ in self.pending])
        after = torch.cat([t for _, t, _ in self.pending])
        root = session.advance(features, after, self.pending[0][2])
        self.pending, self.used_drafter = [], True
        return root

    def defer(self, positions: Tensor, after: Tensor, committed: int) -> None:
        """Verified positions (features, tokens after) from context index `committed`, appended later."""
        self.pending.append((positions, after, committed))

    def observe(
        self, path: list[int], tree: DraftTree, auto: AutoBudget | None, drafted_seconds: float
    ) -> int:
        """After the verification accepted `path`: tell the auto budget how the chain did and, when the
        drafter ran beside a chain, what it added; returns how many accepted nodes the drafter drafted."""
        if auto is not None:
            hits = sum(n in self.lookup_nodes for n in path)
            auto.observe_lookup(len(self.lookup_nodes), hits, self.ngram)
            if self.used_drafter and self.lookup_nodes:  # the drafter's own part beside a chain
                others = len(tree) - 1 - len(self.lookup_nodes)
                auto.observe_gate(len(path) - hits, others, drafted_seconds)
            elif self.used_drafter and not self.offered:  # the drafter alone
                auto.observe_solo(len(path), len(tree) - 1, drafted_seconds)
        return sum(n in self.drafter_nodes for n in path)
