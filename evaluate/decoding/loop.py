"""The speculative decoding loop: a target with a KV cache, a drafter with its own, any verifier.

One iteration (batch 1, as speculative-decoding benchmarks measure):
1. draft from the root (the last emitted token): `chain` (one draft of L tokens), `iid` (K drafts of L
   tokens sampled i.i.d. from the drafter, shared prefixes computed once), `tree` (the drafter's
   dynamic tree), `lookup` (no drafter: up to L tokens copied from an n-gram match in the context,
   lookup.py), or `tree+lookup` (the drafter's tree with the lookup draft grafted on as one more branch);
   `autoregressive` runs the target alone;
2. ONE target forward over [root, draft nodes] with tree attention (a 4-D mask: every node sees the
   committed cache and its ancestors; position ids = cache length + depth), giving the target's logits
   and features at every node;
3. the verifier picks the accepted path and the next token (at temperature 0 every scheme reduces to
   following the target's argmax down the tree: only the argmax of each node's logits is read); the
   target cache keeps the committed part plus the root and the accepted nodes (prefix reuse);
4. the drafter appends the newly verified positions in ONE forward, which also drafts the next root.

Temperature and top-p shape the target law and the draft law identically (temperature.py). Step 1 is
drafts.py; the target side is target.py, the drafter's drafting.py and drafters.py; the laws a cross-iteration verifier's
continuation puts in force are continuations.py's. Timings (IterationStats, Generation) split each
iteration's wall time into drafting, the target forward, verification and the rest (the overhead); the
prefill phase (prompt forward, first token, the drafter's first advance) is kept apart.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import Tensor

from specblock.data.target import FeatureTarget
from specblock.evaluate.decoding.budget import FORWARD_GRID, AutoBudget, measure_forward_curve
from specblock.evaluate.decoding.columns import ColumnRoot, DraftColumns
from specblock.evaluate.decoding.continuations import LawBook
from specblock.evaluate.decoding.drafters import make_session
from specblock.evaluate.decoding.drafting import Prefix, Root
from specblock.evaluate.decoding.drafts import Draft, Drafts
from specblock.evaluate.decoding.graft import LookupGraft
from specblock.evaluate.decoding.lookup import LookupConfig, LookupSession
from specblock.evaluate.decoding.target import TargetSession
from specblock.evaluate.decoding.trees import AUTO, DraftTree, TreeConfig
from specblock.evaluate.decoding.temperature import GREEDY, next_token_law
from specblock.evaluate.verify import CROSS_ITERATION, SINGLE_DRAFT, VERIFIERS, TokenTree, get_verifier
from specblock.evaluate.verify import greedy_path, verify_tree
from specblock.evaluate.verify.randomness import Sampler, TorchSampler

MODES = ("chain", "iid", "tree", "tree+lookup", "lookup", "autoregressive")
TREE_MODES = ("tree", "tree+lookup")  # a dynamic tree verified by the target-only rule
DRAFTERLESS = ("autoregressive", "lookup")  # modes that need no drafter checkpoint


@dataclass
class DecodeConfig:
    """mode: chain | iid | tree | tree+lookup | lookup | autoregressive; verifier: a registered chain/multi-
    draft verifier for chain and iid (chain needs a single-draft one or K = 1), ignored for the trees and
    autoregressive, `token` for lookup (its point-mass draft); num_drafts K and draft_length L for chain /
    iid (L also for lookup and the lookup branch of tree+lookup); tree: the dynamic tree's shape; lookup:
    the n-gram matcher's range."""

    mode: str = "tree"
    verifier: str = "token"
    num_drafts: int = 1
    draft_length: int = 4
    temperature: float = 0.0
    top_p: float = 1.0
    max_new_tokens: int = 64
    tree: TreeConfig = field(default_factory=TreeConfig)
    lookup: LookupConfig = field(default_factory=LookupConfig)
    auto_length: bool = False  # chain / iid: L chosen per iteration (budget.py), draft_length the most

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"decode.mode={self.mode!r} is not one of {MODES}")
        if self.mode in ("chain", "iid") and self.verifier not in VERIFIERS:
            raise ValueError(f"decode.verifier={self.verifier!r} is not one of {sorted(VERIFIERS)}")
        if self.mode == "lookup" and (self.verifier != "token" or self.num_drafts != 1):
            raise ValueError("decode.mode=lookup drafts one point mass, verified by `token` (num_drafts=1)")
        if self.mode == "chain" and self.num_drafts != 1:
            raise ValueError("decode.mode=chain drafts one sequence: set num_drafts=1 (iid drafts several)")
        if self.mode == "iid" and self.verifier in SINGLE_DRAFT and self.num_drafts != 1:
            raise ValueError(f"verifier {self.verifier!r} takes a single draft; use num_drafts=1")
        if self.num_drafts < 1 or self.draft_length < 1 or self.max_new_tokens < 1:
            raise ValueError("num_drafts, draft_length and max_new_tokens must be >= 1")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError(
                f"need temperature >= 0 and 0 < top_p <= 1, got {self.temperature}, {self.top_p}"
            )
        if self.auto_length and self.mode not in ("chain", "iid"):
            raise ValueError(
                f"draft_length=auto chooses the length of a chain or of i.i.d. drafts per iteration: not for "
                f"{self.method} (a tree's size is trees.<drafter>.budget=auto)"
            )

    @property
    def method(self) -> str:
        """The name reports use: tree, lookup, autoregressive, chain-<verifier>, iid-<verifier>."""
        return self.mode if self.mode in (*TREE_MODES, *DRAFTERLESS) else f"{self.mode}-{self.verifier}"


@dataclass
class IterationStats:
    """One verification step. seconds: its wall time in the loop, of which drafter_seconds drafting,
    target_seconds the target forward and verify_seconds verification (the rest is overhead)."""

    accepted: int
    emitted: int
    draft_len: int
    drafter_calls: int
    drafter_seconds: float
    verify_seconds: float
    target_seconds: float = 0.0
    seconds: float = 0.0


@dataclass
class Generation:
    """tokens: the new tokens (the prompt excluded); iterations: one entry per verification; prefill_calls:
    target forwards outside iterations (the prefill; every step of autoregressive decoding).
    prefill_seconds: the wall time until the decoding loop starts (prompt forward, first token, the
    drafter's first advance, whose calls and seconds are prefill_drafter_*), of which
    prefill_target_seconds the prompt's forward; target_seconds: target forward seconds after the
    prefill (autoregressive steps or iterations)."""

    tokens: list[int]
    iterations: list[IterationStats]
    target_calls: int
    prefill_calls: int
    seconds: float
    prefill_seconds: float = 0.0
    target_seconds: float = 0.0
    prefill_drafter_calls: int = 0
    prefill_drafter_seconds: float = 0.0
    prefill_target_seconds: float = 0.0


class Verified(NamedTuple):
    """The verifier's answer: accepted tree nodes (root excluded, in order), the token after them, and
    the continuation it puts in force (None: the next iteration verifies against the plain target)."""

    path: list[int]
    next_token: int
    continuation: object = None


class Step(NamedTuple):
    """What one iteration returns to the loop: its statistics, the tokens it emitted and the next root
    (None after the last iteration)."""

    stats: IterationStats
    emitted: list[int]
    root: Root | None


# ---------------------------------------------------------------- the loop


class SpeculativeDecoder:
    """Generates with a target and (except autoregressive) a drafter; see the module docstring."""

    def __init__(
        self,
        target: FeatureTarget,
        drafter: torch.nn.Module | None,
        cfg: DecodeConfig,
        eos: list[int] = (),
        adapter=None,
    ):
        if cfg.mode not in DRAFTERLESS and drafter is None:
            raise ValueError(f"decode.mode={cfg.mode} needs a drafter")
        self.cfg, self.eos = cfg, set(eos)
        self.target = TargetSession(target)
        self.drafter = None
        if cfg.mode == "lookup":
            self.drafter = LookupSession(cfg.lookup, cfg.draft_length)
        elif drafter is not None and cfg.mode != "autoregressive":
            self.drafter = make_session(drafter, target.vocab_size, cfg.temperature, cfg.top_p)
        self._drafter_accepted = 0  # of the last iteration's accepted nodes, those the drafter drafted
        self.verifier = get_verifier(cfg.verifier) if cfg.mode in ("chain", "iid", "lookup") else None
        self.cross = cfg.mode in ("chain", "iid") and cfg.verifier in CROSS_ITERATION
        self.greedy = cfg.temperature == GREEDY
        # drafts sampled from a drafter are verified over its draft vocabulary's columns (columns.py)
        sampled = not self.greedy and cfg.mode in ("chain", "iid")
        self.columns = DraftColumns(self.drafter.d2t, target.vocab_size) if sampled else None
        # trees.<drafter>.budget=auto: the tree's size chosen per iteration from measured costs (budget.py)
        auto_tree = cfg.mode in TREE_MODES and cfg.tree.budget == AUTO
        self.auto = AutoBudget() if auto_tree or cfg.auto_length else None
        # tree+lookup: prompt lookup's draft grafted on the drafter's tree, the drafter on demand (graft.py); a
        # tree with budget=auto calls its drafter on demand too, only where it is expected to pay (budget.py)
        lookup = cfg.mode == "tree+lookup"
        self.graft = LookupGraft(cfg.lookup, cfg.draft_length, chains=lookup) if lookup or auto_tree else None
        self.calibration_seconds = 0.0  # the auto budget's one-time forward-curve measurement
        self.drafts = Drafts(cfg, self.drafter, self.graft, self.auto, self.greedy, target.vocab_size)
        self.adapter = adapter  # evaluate/adapt/: fed the verified positions, told when a request ends

    def _sample(self, logits: Tensor, gen: Sampler) -> int:
        if self.greedy:
            return int(logits.argmax())  # = argmax of next_token_law's one-hot, without forming it
        return gen.categorical(next_token_law(logits, self.cfg.temperature, self.cfg.top_p))

    def generate(self, prompt: list[int], seed: int = 0, sampler: Sampler | None = None) -> Generation:
        """New tokens after `prompt`. Every random choice (drafts, verification, target samples) goes
        through one Sampler: a TorchSampler seeded with `seed`, or `sampler` (e.g. the exact-enumeration
        one of verify/exact.py, which makes the law of whole generations computable)."""
        if not prompt:
            raise ValueError("the prompt must hold at least one token")
        gen = sampler if sampler is not None else TorchSampler(torch.Generator().manual_seed(seed))
        start = time.perf_counter()
        self.target.reset()
        # prefill; the adapter learns from the target's logits at every prompt position, nothing else does
        features, logits = self.target.forward(list(prompt), last_logits_only=self.adapter is None)
        out = [self._sample(logits[-1], gen)]
        if self.cfg.mode == "autoregressive":
            prefill_seconds, prefill_target = time.perf_counter() - start, self.target.seconds
            while len(out) < self.cfg.max_new_tokens and out[-1] not in self.eos:
                _, logits = self.target.forward([out[-1]])
                out.append(self._sample(logits[-1], gen))
            n = self.target.calls
            wall, decode_target = time.perf_counter() - start, self.target.seconds - prefill_target
            return Generation(
                out, [], n, n, wall, prefill_seconds, decode_target, prefill_target_seconds=prefill_target
            )
        self.drafter.reset()
        after = torch.tensor([*prompt[1:], out[0]])
        if self.adapter is not None:
            self.adapter.new_request()
            self.adapter.collect(features, after, logits)
        if self.graft is not None:  # on demand: the first iteration that wants the drafter appends these
            root = None
            self.graft.start(features, after)
        else:
            root = self.drafter.advance(features, after, 0)
        if self.auto is not None and self.auto.curve is None:  # once per decoder, off the clock
            t = time.perf_counter()
            most = self.cfg.draft_length * (self.cfg.num_drafts if self.cfg.mode == "iid" else 1)
            if self.cfg.mode in TREE_MODES:  # the lookup branch adds up to draft_length nodes
                most = self.cfg.tree.max_budget + (
                    self.cfg.draft_length if self.cfg.mode == "tree+lookup" else 0
                )
            grid = [n for n in FORWARD_GRID if n <= most] + [most + 1]
            self.auto.curve = measure_forward_curve(self.target.probe, tuple(sorted(set(grid))))
            self.calibration_seconds = time.perf_counter() - t
            start += self.calibration_seconds
        prefill_draft = self.drafter.cost.take()  # reported with the prefill
        prefill_seconds, prefill_target = time.perf_counter() - start, self.target.seconds
        book, iterations = LawBook(), []
        while len(out) < self.cfg.max_new_tokens and out[-1] not in self.eos:
            t0 = time.perf_counter()
            stats, emitted, root = self._iteration(prompt, out, root, book, gen)
            room = self.cfg.max_new_tokens - len(out)
            kept = emitted[:room]
            for i, t in enumerate(kept):  # stop at the first end-of-sequence token
                if t in self.eos:
                    kept = kept[: i + 1]
                    break
            stats.emitted = len(kept)
            stats.accepted = min(stats.accepted, len(kept))
            out += kept
            stats.seconds = time.perf_counter() - t0
            iterations.append(stats)
            if self.graft is not None and self.auto is not None:  # the loop's own cost, for the gate
                self.auto.observe_other(stats.seconds - stats.target_seconds - stats.drafter_seconds)
            drafted = self.graft is None or self.graft.used_drafter  # not a plain step nor a chain alone
            if self.auto is not None and drafted:  # calibrated on the drafter's own nodes (not a lookup's)
                fixed = stats.seconds - stats.target_seconds - self.drafts.variable_seconds
                self.auto.observe(self.drafts.scores, min(stats.accepted, self._drafter_accepted), fixed)
                if self.drafts.up_front:
                    self.auto.observe_depths(stats.draft_len, stats.accepted, fixed)
        result = Generation(
            out, iterations, self.target.calls, 1, time.perf_counter() - start, prefill_seconds,
            self.target.seconds - prefill_target, prefill_draft.calls, prefill_draft.seconds, prefill_target,
        )  # fmt: skip
        if self.adapter is not None:
            self.adapter.observe_request(len(out), result.target_calls, result.seconds)
        return result

    def _iteration(self, prompt: list[int], out: list[int], root: Root, book: LawBook, gen: Sampler) -> Step:
        base = tuple(out)  # generated so far; the root token is out[-1]
        committed = len(prompt) + len(out) - 1  # target cache entries before the root
        shortest = 1
        if self.drafts.up_front and book.levels:  # a block reaches the newest continuation's horizon
            shortest = book.levels[-1].horizon - len(out)  # (continuations.py)
        draft = self.drafts.draft(root, gen, [*prompt, *out], shortest)
        tree = draft.tree
        target_before = self.target.seconds
        features, logits = self.target.forward([out[-1], *tree.tokens[1:]], [-1, *tree.parents[1:]])
        target_seconds = self.target.seconds - target_before
        if self.auto is not None:  # the load factor of the auto budget's forward curve
            self.auto.observe_forward(len(tree.tokens), target_seconds)
        t0, drafted_before = time.perf_counter(), self.drafter.cost.seconds
        cols = self.columns  # where set, the law book's prefixes are columns (columns.py)
        key = base if cols is None else cols.cols(base)
        verified = self._verify(draft, logits, key, book, gen)
        # drafter calls made for a continuation's draft laws count as drafting, not verification
        verify_seconds = time.perf_counter() - t0 - (self.drafter.cost.seconds - drafted_before)
        path = verified.path
        self._drafter_accepted = len(path)
        if self.auto is not None and self.auto.tree_rounds:  # what the tree's further rounds added
            self.auto.observe_round_yield(tree.rounds[1:], [tree.rounds[n] for n in path])
        if self.graft is not None:  # who drafted the accepted nodes (drafting is all done by now)
            self._drafter_accepted = self.graft.observe(path, tree, self.auto, self.drafter.cost.seconds)
        emitted = [tree.tokens[n] for n in path] + [verified.next_token]
        self.target.keep(committed, [0, *path])
        if self.cross:
            after = key + (tuple(emitted) if cols is None else cols.cols(emitted))
            root = root if cols is None else ColumnRoot(root, cols)
            book.carry(key, draft.tokens.shape[1], verified.continuation, root, after)  # this block's L
        else:
            book.plain.clear()
        # the verified positions: the root and the accepted nodes, each with the token after it
        positions, after = features[[0, *path]], torch.tensor(emitted)
        if self.adapter is not None:  # the feedback verification gives for free
            self.adapter.collect(positions, after, logits[[0, *path]])
        # the drafter appends them, not after the last iteration (nothing would read it)
        done = len(out) + len(emitted) >= self.cfg.max_new_tokens or bool(self.eos & set(emitted))
        if done or self.graft is not None:  # tree+lookup: appended when a later iteration wants the drafter
            new_root = None
            if not done:
                self.graft.defer(positions, after, committed)
        else:
            new_root = self.drafter.advance(positions, after, committed)
        drafted = self.drafter.cost.take()
        if self.graft is not None:  # the n-gram match counts as drafting time (no drafter call)
            drafted = drafted._replace(seconds=drafted.seconds + self.graft.lookup.cost.take().seconds)
        depth = max(tree.depth) if draft.tokens is None else draft.tokens.shape[1]
        stats = IterationStats(
            len(path), len(emitted), depth, drafted.calls, drafted.seconds, verify_seconds, target_seconds
        )
        return Step(stats, emitted, new_root)

    def _verify(self, draft: Draft, logits: Tensor, base: Prefix, book: LawBook, gen: Sampler) -> Verified:
        """The verifier's answer on the target's logits [N, V] at every node of the draft tree; `base`: the
        law book's key of the tokens generated before this iteration's root (columns where `self.columns`
        is set, columns.py)."""
        if self.greedy:  # every scheme: follow the target's argmax (no [V] law is formed)
            return Verified(*greedy_path(draft.tree, logits))
        laws = next_token_law(logits, self.cfg.temperature, self.cfg.top_p)  # [N, V] float32 per node
        if draft.tokens is None:  # a dynamic tree, target-only rule
            res = verify_tree(_as_token_tree(draft.tree), laws, mode="deterministic", sampler=gen)
            return Verified(res.path, res.next_token)
        cols, rows, tokens = self.columns, laws, draft.tokens
        paths = [draft.tree.path_tokens(n) for n in range(len(draft.tree))]
        if cols is not None:  # a drafter's draft: its vocabulary's columns and one for the rest (columns.py)
            rows, paths = cols.target(laws), [cols.cols(y) for y in paths]
            tokens = torch.tensor([cols.cols(x) for x in tokens.tolist()], dtype=torch.int64)
        book.add_rows(base, paths, rows)
        L = tokens.shape[1]
        prefixes = [[base + tuple(row[:i]) for i in range(L + 1)] for row in tokens.tolist()]
        book.prefetch([g for row in prefixes for g in row])
        target_probs = book.laws(prefixes)  # [K, L+1, V] (columns: [K, L+1, Vd+1])
        res = self.verifier(target_probs, draft.probs, tokens, sampler=gen)
        nodes = draft.nodes[res.draft_index]
        token = res.next_token
        if cols is not None:  # the rest column: the token from the target's law there (columns.py)
            token = cols.token(token, laws[nodes[res.num_accepted]], gen)
        return Verified(nodes[1 : res.num_accepted + 1], token, res.continuation)


def _as_token_tree(tree: DraftTree) -> TokenTree:
    return TokenTree(list(tree.parents), [0, *tree.tokens[1:]])
