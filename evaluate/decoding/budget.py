"""`trees.<drafter>.budget=auto`: the draft tree's size chosen per iteration from measured costs.

A fixed budget (EAGLE-2 and SpecBlock ship 60-90 tokens, tuned for one GPU) is wrong on a machine where
a wide forward costs much more than a narrow one: on this 2-core CPU a 33-token float32 forward of
SmolLM2 costs ~2.4x a one-token step, on an H200 it costs about the same as one. The model here:

    tokens per second(B) = (1 + c * sum_{i <= B} a_i) / (fixed + rounds * round + forward(B + 1))

- a_i: the i-th best node's cumulative draft probability exp(score) (nodes sorted as `DraftTree.pruned`
  sorts them, so every prefix of the order is ancestor-closed). EAGLE-2's observation: a node's draft
  confidence tracks the chance that the target accepts the path to it. At temperature 0 the expected
  number of accepted nodes of a tree is the sum over nodes of the chance that the target's greedy path
  passes through them, which c * a_i estimates.
- c: a calibration factor learned online, (prior + accepted) / (prior + predicted) over the iterations
  so far (accepted: nodes the verifier accepted; predicted: sum of a_i over the nodes drafted), so an
  over-confident drafter gets smaller trees; clipped to [C_MIN, C_MAX].
- forward(n): the target forward over n tokens after the committed cache, measured once per decoder on
  the first prompt's cache (FORWARD_GRID, the fastest of `repeats`, made non-decreasing by isotonic
  regression: `measure_forward_curve`), interpolated linearly in between, times
  a load factor: every verification forward's measured ms over the curve's (decayed sums, LOAD_DECAY),
  so a curve measured during a load spike (or a machine that gets busier later) is rescaled online.
- fixed: the iteration's cost outside the target forward and the tree's drafter rounds (verification,
  the loop's bookkeeping, the drafter's advance), the running mean of what the loop measured.
- The tree's depth: before each further drafter round (an EAGLE step, a SpecBlock block round) the
  round is drafted only if children as likely as their parents (optimistic) could raise the best
  rate with that round's cost (`round`, the running mean per round) added to `fixed`; the first round
  comes with the root and costs nothing. Optimism is then checked against the round's measured record
  (`round_pays`): over the iterations that drafted further round r, the accepted nodes, kept nodes and
  drafter rounds that rounds >= r added (decayed means g, b, k); the round is drafted only if
  (1 + c S_B + g) / (fixed + k * round + forward(B + 1 + b)) beats the tree without it, or as a probe every
  PROBE_EVERY-th time it is asked. A one-block SpecBlock drafter's second round (a block it never trained)
  added 0.13 accepted nodes for 9 ms here and is now mostly cut (`scripts/ab_tree_rounds.py`, README).

The chosen B maximises the model over 1 <= B <= the nodes drafted.

`tree+lookup` with budget=auto puts prompt lookup's chain into the same choice: its i-th token's
confidence is the measured rate at which lookup tokens at depth i after a match of the same n-gram length
were accepted so far (a prior of 0.5 over 2 pseudo-counts, never rising with depth), counted once c is
divided out (c calibrates the drafter's scores only); the drafter's further rounds are weighed with the
chain already in the tree, and the union of the drafter's nodes and the chain's is cut to its best B
nodes. Before drafting, `lookup_alone` decides whether the drafter runs at all this iteration.

A `tree` with budget=auto asks the same gate with no chain: the drafter is called on demand (graft.py), and
an iteration takes a plain one-token target step where the drafter's recent record (accepted nodes, nodes and
drafter ms per drafted iteration, decayed by GATE_DECAY) says its call and the wider forward cost more than
its tokens win, 1 / (other + forward(1)) >= (1 + g) / (other + d + forward(1 + b)). Every PROBE_EVERY-th
iteration drafts anyway, so the record follows the text. A drafter that does not pay thus costs a few percent
instead of making decoding slower than the target alone (the quick SpecBlock drafter on GSM8K: 0.92-0.93x
against 0.79-0.84x of plain decoding, `scripts/ab_solo_gate.py`).

`draft_length=auto` (chain methods) applies the same model to a chain drafted token by token, where
drafting is not sunk: each further token costs `draft_ms` (the running mean per drafted token), so

    rate(L) = (1 + c * sum_{i<=L} a_i) / (fixed + L * draft_ms + forward(L + 1)),

a_i the chain's cumulative draft probability up to token i. Drafting stops at `max_draft_length` or
once even an optimistic next token (a_{L+1} = a_L) would not raise the best rate so far; the chain is
then cut to its best length (its drafting paid, `choose_budget`). Any ancestor-closed subtree of a
draft tree is a valid draft tree, so the choice changes speed only, never the output: greedy equality
and the law of generations stay as they are (tests/evaluate/test_budget.py).

`draft_length=auto` for K i.i.d. drafts and for the verifiers whose continuation spans the block
(greedy_block, spectr_gbv) chooses L before anything is drafted (`choose_up_front`), from past iterations
only, so every iteration is a valid verification of fixed-length drafts and the output stays exact:

    rate(L) = (1 + sum_{i<=L} A_i) / (fixed(L) + L * draft_ms + forward(K * L + 1)),

A_i the measured share of the iterations that offered depth i and accepted at least i tokens (DEPTH_PRIOR
pseudo-counts at DEPTH_PRIOR_RATE^i behind it, made non-increasing in i), draft_ms the drafting ms per
depth, fixed(L) the mean time outside the target forward and the drafting of the iterations that drafted
L (the overall mean until FIXED_MIN of them are seen): SpecTr-GBV's verification builds its continuation's
rows, which grow with L (0.19 ms / token at L = 2, 0.76-0.80 at L = 4, session 41). Every PROBE_EVERY-th
choice drafts one token longer than the best, so the next depth stays measured. For a cross-iteration
verifier L is at least what reaches the horizon of the continuation in force (horizons never shrink:
continuations.py reads the plain target past the newest one). On this 2-core CPU the K = 4
drafts' forward over K * L + 1 tokens is what it weighs: bf16 9 tokens ~38 ms, 17 ~47 ms (session 41).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

FORWARD_GRID = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)
PROBE_REPEATS = 7  # walks of the grid by `measure_forward_curve` (~3 s on this CPU for 1-33 tokens)
C_MIN, C_MAX = 0.05, 2.0
PRIOR = 4.0  # pseudo-counts behind c = 1 before any iteration
# The load factor follows the machine: an iteration's weight halves after ~3 iterations; clipped so that
# one stalled forward cannot swing the model by more than 4x either way.
LOAD_DECAY = 0.8
LOAD_MIN, LOAD_MAX = 0.25, 4.0
# tree+lookup: the lookup chain's i-th token is accepted at rate (LOOKUP_PRIOR * LOOKUP_PRIOR_RATE +
# accepted_i) / (LOOKUP_PRIOR + drafted_i), measured per depth over the iterations so far
LOOKUP_PRIOR, LOOKUP_PRIOR_RATE = 2.0, 0.5
GATE_MIN = 4  # tree+lookup: iterations with a chain and the drafter measured before the chain may go alone
# a tree without a chain: drafted iterations measured before the gate may take a plain step. An answer's
# first iterations are the hardest to draft (the quick SpecBlock drafter on 2 GSM8K prompts: 0-1 nodes
# accepted in each answer's first 4 iterations, ~0.25 a call, then 0.6-0.9): at 4 they closed the gate for
# 7-14 iterations at the start of a fresh decoder (session 43); an untrained drafter costs 16 calls once
SOLO_MIN = 16
# a drafter that does not pay is still asked every PROBE_EVERY-th iteration, so that the gate sees a change
# (another kind of text, a better stretch of the drafter) instead of deciding once for the whole generation
PROBE_EVERY = 8
# draft_length=auto for i.i.d. drafts and cross-iteration verifiers: the prior behind the share of iterations
# that accept at least i tokens, DEPTH_PRIOR pseudo-counts at DEPTH_PRIOR_RATE ** i
DEPTH_PRIOR, DEPTH_PRIOR_RATE = 2.0, 0.5
# ... and the iterations of one length seen before their own mean time outside the forward prices that length
FIXED_MIN = 3
SOLO_DECAY = 0.8  # the further rounds' record (round_pays): a drafted iteration's weight halves after ~3
# The gate's memory of the drafter's worth without a chain (observe_solo): a drafted iteration's weight
# halves after ~14. At 0.8 (halving after ~3, until session 42) the means of ~5 noisy iterations (0, 1 or 2
# nodes accepted) fell below break-even by chance and closed the gate for 7 iterations at a time: the quick
# SpecBlock drafter's tree made 1.02-1.24x against 1.14-1.32x at 0.95 (bf16, 4 prompts of 48 tokens on each
# of the five sets, session 43, scripts/ab_gate_memory.py), and 0.95 still keeps an untrained drafter from
# being called (0.94x against 0.84x with no gate).
GATE_DECAY = 0.95


@dataclass
class ForwardCurve:
    """ms of one target forward against the tokens fed (sizes ascending), linear in between and beyond.
    Every size asked is remembered (the budget's choice asks the same few dozen sizes every iteration)."""

    sizes: list[int]
    ms: list[float]
    _known: dict[int, float] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __call__(self, n: int) -> float:
        known = self._known.get(n)
        if known is None:
            known = self._known[n] = self._interpolate(n)
        return known

    def _interpolate(self, n: int) -> float:
        s, t = self.sizes, self.ms
        if len(s) == 1:
            return t[0]
        i = next((j for j in range(1, len(s)) if n <= s[j]), len(s) - 1)
        return t[i - 1] + (t[i] - t[i - 1]) * (n - s[i - 1]) / (s[i] - s[i - 1])


def measure_forward_curve(
    forward: Callable[[int], float], grid: tuple[int, ...] = FORWARD_GRID, repeats: int = PROBE_REPEATS
) -> ForwardCurve:
    """`forward(n)` runs one target forward over n tokens (restoring the cache) and returns its seconds.
    The grid is walked `repeats` times, interleaved; each size keeps its FASTEST time, and the sizes are
    then made non-decreasing by isotonic regression (`isotonic`), not by a running maximum.

    On a shared CPU a forward's time is its cost plus interference, which only ever adds: the minimum is
    the stable estimate of the cost (session 26, this 2-core EPYC, five curves of 7 walks each: a 1-token
    forward's median ranged over 40-50 ms, its minimum over 33-37), and the loop's load factor
    (`AutoBudget.load`) rescales the whole curve to what the verification forwards then measure. What the
    choice needs from the probe is the SHAPE: which widths cost more than which. With a median of 3 and a
    running maximum, one slow 2-token forward lifted every wider size to its time, so that 16 tokens
    looked as cheap as 2, and trees of 15 nodes were chosen whose forwards took 58 ms against 46 for 4."""
    times: dict[int, list[float]] = {n: [] for n in grid}
    for _ in range(repeats):
        for n in grid:
            times[n].append(forward(n) * 1e3)
    return ForwardCurve(list(grid), isotonic([min(times[n]) for n in grid]))


def isotonic(values: list[float]) -> list[float]:
    """The non-decreasing sequence closest to `values` in squared error (pool adjacent violators): a run
    of sizes measured out of order becomes their mean, so that a wider forward never costs less and one
    outlier moves its neighbours by its share of the run instead of lifting every size after it."""
    blocks: list[list[float]] = []  # [sum, count] of each pooled run, means non-decreasing
    for v in values:
        blocks.append([v, 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return [total / count for total, count in blocks for _ in range(int(count))]


class Choice(NamedTuple):
    """A budget (or chain length) and the tokens per ms the model expects at it."""

    size: int
    rate: float


def choose_budget(
    confidences: list[float], forward: Callable[[int], float], fixed_ms: float, c: float = 1.0
) -> Choice:
    """The budget B (1 <= B <= len(confidences)) maximising (1 + c * sum_{i<=B} a_i) / (fixed_ms +
    forward(B + 1)); confidences a_i in the pruning order (best first). Returns (B, expected tokens per
    ms at B)."""
    best, best_rate, gain = 1, -1.0, 1.0
    for b, a in enumerate(confidences, start=1):
        gain += c * a
        rate = gain / (fixed_ms + forward(b + 1))
        if rate > best_rate:
            best, best_rate = b, rate
    return Choice(best, best_rate)


@dataclass
class AutoBudget:
    """The online state of the choice for one decoder: the forward curve, c and the fixed cost."""

    curve: ForwardCurve | None = None
    accepted: float = 0.0
    predicted: float = 0.0
    fixed_total_ms: float = 0.0
    iterations: int = 0
    chosen: list[int] = field(default_factory=list)  # B (or L) per iteration, for the report
    drafted: int = 0  # chain tokens drafted so far, and their drafter seconds
    rounds: int = 0  # tree drafter rounds after the first (whose logits come with the root), their seconds
    round_total_ms: float = 0.0
    draft_total_ms: float = 0.0
    forward_seen_ms: float = 0.0  # decayed sums of measured and curve-modelled verification forwards
    forward_modelled_ms: float = 0.0
    # tree+lookup, per length of the matched n-gram, per depth: chain tokens kept, and accepted
    lookup_drafted: dict[int, list[int]] = field(default_factory=dict)
    lookup_accepted: dict[int, list[int]] = field(default_factory=dict)
    gate_iterations: int = 0  # tree+lookup iterations with a chain that ran the drafter, and sums over them:
    gate_gain: float = 0.0  # accepted nodes the chain did not have
    gate_nodes: float = 0.0  # nodes the chain did not have (the drafter's share of the forward)
    gate_ms: float = 0.0  # drafter ms (catching up on the verified positions, and the rounds)
    other_ms: float = 0.0  # tree+lookup: decayed sums of the loop's own ms per iteration (outside the
    other_weight: float = 0.0  # target forward and drafting) and of the weights
    solo_iterations: int = 0  # iterations without a lookup chain that ran the drafter, and decayed sums over
    solo_gain: float = 0.0  # them (GATE_DECAY, so that the gate follows the text: a stretch the drafter knows
    solo_nodes: float = 0.0  # opens it, a probe that fails closes it): accepted nodes, nodes verified,
    solo_ms: float = 0.0  # drafter ms (catching up on the verified positions, and the rounds), and the
    solo_weight: float = 0.0  # weights
    gate_decay: float = GATE_DECAY  # their decay per drafted iteration (scripts/ab_gate_memory.py varies it)
    skipped: int = 0  # iterations the gate decided without the drafter (plain steps or a chain alone)
    since_drafter: int = 0  # consecutive such iterations (PROBE_EVERY)
    # trees: what the further drafter rounds were measured to add, per round r >= 1 (r = 1: the tree's
    # second round), decayed sums (SOLO_DECAY) over the iterations that drafted round r: accepted nodes and
    # kept nodes from rounds >= r, drafter rounds >= r, weights; and the iterations that measured it
    round_gain: dict[int, float] = field(default_factory=dict)
    round_nodes: dict[int, float] = field(default_factory=dict)
    round_calls: dict[int, float] = field(default_factory=dict)
    round_weight: dict[int, float] = field(default_factory=dict)
    round_seen: dict[int, int] = field(default_factory=dict)
    round_since: dict[int, int] = field(default_factory=dict)  # times round r was asked and refused since
    rounds_cut: int = 0  # further rounds the measured record refused (for the report)
    tree_rounds: int = 0  # further rounds drafted in this iteration's tree so far
    # draft_length=auto chosen up front (i.i.d. drafts, cross-iteration verifiers), per depth i >= 1 (index
    # i - 1): iterations whose drafts reached depth i, and those of them that accepted at least i tokens
    depth_offered: list[int] = field(default_factory=list)
    depth_reached: list[int] = field(default_factory=list)
    up_front_choices: int = 0
    fixed_by_length: dict[int, list[float]] = field(default_factory=dict)  # L -> [total ms, iterations]

    @property
    def c(self) -> float:
        return min(C_MAX, max(C_MIN, (PRIOR + self.accepted) / (PRIOR + self.predicted)))

    @property
    def load(self) -> float:
        """Measured over modelled verification forward time (1 before any)."""
        if self.forward_modelled_ms <= 0:
            return 1.0
        return min(LOAD_MAX, max(LOAD_MIN, self.forward_seen_ms / self.forward_modelled_ms))

    def forward(self, n: int) -> float:
        """Modelled ms of a target forward over n tokens now: the curve times the load factor."""
        return self.load * self.curve(n)

    def observe_forward(self, tokens: int, seconds: float) -> None:
        """A verification forward over `tokens` tokens took `seconds`."""
        self.forward_seen_ms = LOAD_DECAY * self.forward_seen_ms + seconds * 1e3
        self.forward_modelled_ms = LOAD_DECAY * self.forward_modelled_ms + self.curve(tokens)

    @property
    def fixed_ms(self) -> float:
        return self.fixed_total_ms / self.iterations if self.iterations else 0.0

    def choose(self, scores: list[float]) -> int:
        """scores: cumulative draft log-probs of the drafted nodes (root excluded), any order."""
        confidences = sorted((math.exp(s) for s in scores), reverse=True)
        if not confidences:
            return 0
        b = choose_budget(confidences, self.forward, self.fixed_ms, self.c).size
        self.chosen.append(b)
        return b

    @property
    def round_ms(self) -> float:
        return self.round_total_ms / self.rounds if self.rounds else 0.0

    def more_rounds(self, scores: list[float], frontier: list[float]) -> int:
        """Trees: before another drafter round expanding `frontier` (its nodes' scores; `scores`: every
        node's so far): how many frontier nodes are worth expanding, 0 for none. Children as likely as
        their parents (optimistic: a_child <= a_parent) must raise the best modelled rate once that round's
        drafting (`round_ms`) is paid; then only the frontier nodes whose children could be among that
        optimistic best budget's nodes are worth it (a child is never likelier than its parent)."""
        conf = sorted((math.exp(s) for s in scores), reverse=True)
        tree = choose_budget(conf, self.forward, self.fixed_ms, self.c) if conf else None
        now = tree.rate if tree else 0.0
        front = [math.exp(s) for s in frontier]
        hoped = sorted(conf + front, reverse=True)
        best = choose_budget(hoped, self.forward, self.fixed_ms + self.round_ms, self.c)
        if best.rate <= now or not self.round_pays(self.tree_rounds + 1, conf, tree):
            return 0
        self.tree_rounds += 1
        return sum(a >= hoped[best.size - 1] for a in front)

    def round_pays(self, r: int, conf: list[float], tree: Choice | None) -> bool:
        """Whether further round r (1: the tree's second) is expected to pay by its measured record: the best
        tree without it (`tree`: the budget B chosen over the confidences `conf`, None for no node), (1 + c
        S_B) / (fixed + forward(B + 1)), against (1 + c S_B + g) / (fixed + k round +
        forward(B + 1 + b)), g, b, k the decayed means of the accepted nodes, kept nodes and drafter rounds
        that rounds >= r added where they ran. Optimism alone (`more_rounds`) drafts rounds that a weakly
        trained later block (a SpecBlock drafter trained with one block, whose second round reuses it
        untrained) or a deep EAGLE step does not repay. Until GATE_MIN iterations have measured round r,
        and every PROBE_EVERY-th time it is asked, it is drafted (the record follows the text). Reads past
        iterations only, so the output stays exact (any ancestor-closed draft tree is valid)."""
        if self.round_seen.get(r, 0) < GATE_MIN or self.round_since.get(r, 0) + 1 >= PROBE_EVERY:
            self.round_since[r] = 0
            return True
        w = self.round_weight[r]
        g, b, k = self.round_gain[r] / w, self.round_nodes[r] / w, self.round_calls[r] / w
        size = tree.size if tree else 0
        gain = 1.0 + self.c * sum(conf[:size])
        without = tree.rate if tree else gain / (self.fixed_ms + self.forward(1))
        with_round = (gain + g) / (self.fixed_ms + k * self.round_ms + self.forward(round(size + 1 + b)))
        if with_round > without:
            self.round_since[r] = 0
            return True
        self.round_since[r] = self.round_since.get(r, 0) + 1
        self.rounds_cut += 1
        return False

    def observe_round_yield(self, kept_rounds: list[int], accepted_rounds: list[int]) -> None:
        """After verifying a drafter tree with `tree_rounds` further rounds: kept_rounds, the round of each
        node it kept (root excluded); accepted_rounds, of each accepted node. Resets `tree_rounds`."""
        for r in range(1, self.tree_rounds + 1):
            self.round_seen[r] = self.round_seen.get(r, 0) + 1
            for stats, v in (
                (self.round_gain, sum(x >= r for x in accepted_rounds)),
                (self.round_nodes, sum(x >= r for x in kept_rounds)),
                (self.round_calls, self.tree_rounds - r + 1),
                (self.round_weight, 1),
            ):
                stats[r] = SOLO_DECAY * stats.get(r, 0.0) + v
        self.tree_rounds = 0

    def observe_rounds(self, rounds: int, seconds: float) -> None:
        self.rounds += rounds
        self.round_total_ms += seconds * 1e3

    @property
    def draft_ms(self) -> float:
        return self.draft_total_ms / self.drafted if self.drafted else 0.0

    def _chain_rate(self, confidences: list[float], n: int) -> float:
        gain = 1.0 + self.c * sum(confidences[:n])
        return gain / (self.fixed_ms + n * self.draft_ms + self.forward(n + 1))

    def draft_more(self, confidences: list[float]) -> bool:
        """Chains: after drafting len(confidences) tokens, whether one more could raise the best rate."""
        n = len(confidences)
        best = max(self._chain_rate(confidences, m) for m in range(1, n + 1))
        return self._chain_rate([*confidences, confidences[-1]], n + 1) > best

    def choose_length(self, confidences: list[float]) -> int:
        """Chains: the best length among the drafted tokens (their drafting is paid)."""
        fixed = self.fixed_ms + len(confidences) * self.draft_ms
        b = choose_budget(confidences, self.forward, fixed, self.c).size
        self.chosen.append(b)
        return b

    def depth_acceptance(self, longest: int) -> list[float]:
        """A_1..A_longest: the chance that an iteration accepts at least i tokens, measured per depth over
        the iterations that offered it (DEPTH_PRIOR pseudo-counts at DEPTH_PRIOR_RATE ** i), made
        non-increasing."""
        out: list[float] = []
        for i in range(1, longest + 1):
            offered = self.depth_offered[i - 1] if i <= len(self.depth_offered) else 0
            reached = self.depth_reached[i - 1] if i <= len(self.depth_reached) else 0
            a = (reached + DEPTH_PRIOR * DEPTH_PRIOR_RATE**i) / (offered + DEPTH_PRIOR)
            out.append(min(a, out[-1]) if out else a)
        return out

    def choose_up_front(self, width: int, longest: int, shortest: int = 1) -> int:
        """i.i.d. drafts and cross-iteration verifiers: the draft length L (shortest <= L <= longest) for
        `width` drafts, chosen before drafting by rate(L) (module docstring); every PROBE_EVERY-th choice
        is one longer than the best, so the next depth stays measured (not `longest`: a cross-iteration
        verifier's long block sets a far horizon that the next blocks must reach, and in the main job's
        T = 0.7 stage probing L = 8 made SpecTr-GBV 0.69x). Reads past iterations only."""
        self.up_front_choices += 1
        shortest = max(1, min(shortest, longest))
        acc, best, best_rate = self.depth_acceptance(longest), shortest, -1.0
        for n in range(shortest, longest + 1):
            rate = (1.0 + sum(acc[:n])) / (self.fixed_at(n) + n * self.draft_ms + self.forward(width * n + 1))
            if rate > best_rate:
                best, best_rate = n, rate
        if self.up_front_choices % PROBE_EVERY == 0:
            best = min(longest, best + 1)
        self.chosen.append(best)
        return best

    def fixed_at(self, length: int) -> float:
        """fixed(L): the mean ms outside the target forward of the iterations that drafted `length`
        (choose_up_front), once FIXED_MIN are seen; the overall mean before."""
        total, seen = self.fixed_by_length.get(length, (0.0, 0))
        return total / seen if seen >= FIXED_MIN else self.fixed_ms

    def observe_depths(self, length: int, accepted: int, fixed_seconds: float | None = None) -> None:
        """An iteration of drafts of `length` tokens accepted `accepted` of them and spent `fixed_seconds`
        outside the target forward and the drafting (choose_up_front)."""
        if fixed_seconds is not None:
            row = self.fixed_by_length.setdefault(length, [0.0, 0])
            row[0] += fixed_seconds * 1e3
            row[1] += 1
        if length > len(self.depth_offered):
            self.depth_reached += [0] * (length - len(self.depth_offered))
            self.depth_offered += [0] * (length - len(self.depth_offered))
        for i in range(length):
            self.depth_offered[i] += 1
            self.depth_reached[i] += accepted > i

    def observe_drafting(self, tokens: int, seconds: float) -> None:
        self.drafted += tokens
        self.draft_total_ms += seconds * 1e3

    def lookup_confidences(self, n: int, ngram: int = 0) -> list[float]:
        """tree+lookup: the chance that each of a lookup chain's first n tokens is accepted, for a chain that
        followed a match of an `ngram`-token suffix (the measured rate per match length and depth, never
        rising with depth: a deeper token needs the ones before it; a 3-gram match is a better bet than a
        1-gram one)."""
        out, prev = [], 1.0
        seen, hits = self.lookup_drafted.get(ngram, []), self.lookup_accepted.get(ngram, [])
        for i in range(n):
            drafted = seen[i] if i < len(seen) else 0
            accepted = hits[i] if i < len(hits) else 0
            prev = min(prev, (LOOKUP_PRIOR * LOOKUP_PRIOR_RATE + accepted) / (LOOKUP_PRIOR + drafted))
            out.append(max(prev, 1e-6))
        return out

    def lookup_alone(self, n: int, ngram: int = 0) -> int | None:
        """tree+lookup (and a `tree` with budget=auto, which has no chain: n = 0), before drafting: how many of
        a lookup chain's n tokens to verify WITHOUT the drafter (no drafter call this iteration; 0: a plain
        one-token step of the target), or None to draft with it.
        - With a chain, the chain alone is cut to its best length B by the cost model, then (1 + S_B) /
          (other + forward(B + 1)) is compared with (1 + S_B + g) / (other + d + forward(B + 1 + b)): S_B the
          chain's confidences summed, and g, b, d the drafter's accepted nodes, nodes and ms per iteration
          when it ran beside a chain (means).
        - Without a chain, a plain step 1 / (other + forward(1)) is compared with (1 + g) / (other + d +
          forward(1 + b)), g, b, d the decayed means over the iterations where the drafter ran without a
          chain: a drafter whose acceptance does not pay for its call (and for the wider forward) is not
          called, until a probe finds it paying again.
        The drafter runs until GATE_MIN (with a chain; SOLO_MIN without) such iterations are measured, and
        at least every PROBE_EVERY-th iteration (the measurements go on). The choice reads past iterations
        only, never this iteration's draft, so the output stays exact (any draft tree, the empty one
        included, is valid)."""
        k = self.gate_iterations if n else self.solo_iterations
        if k < (GATE_MIN if n else SOLO_MIN) or self.since_drafter + 1 >= PROBE_EVERY:
            return self._drafter()
        other = self.other_ms / self.other_weight if self.other_weight else 0.0
        if n:
            g, b, d = self.gate_gain / k, self.gate_nodes / k, self.gate_ms / k
            conf = self.lookup_confidences(n, ngram)
            alone = choose_budget(conf, self.forward, other)
            size, gain = alone.size, 1 + sum(conf[: alone.size])
            rate = alone.rate
        else:
            w = self.solo_weight
            g, b, d = self.solo_gain / w, self.solo_nodes / w, self.solo_ms / w
            size, gain = 0, 1.0
            rate = gain / (other + self.forward(1))
        with_drafter = (gain + g) / (other + d + self.forward(round(size + 1 + b)))
        if rate < with_drafter:
            return self._drafter()
        self.skipped += 1
        self.since_drafter += 1
        return size

    def _drafter(self) -> None:
        self.since_drafter = 0
        return None

    def observe_solo(self, gain: int, nodes: int, seconds: float) -> None:
        """An iteration without a lookup chain ran the drafter: it accepted `gain` nodes of the `nodes` it
        verified and spent `seconds` drafting."""
        self.solo_iterations += 1
        decay = self.gate_decay
        self.solo_gain = decay * self.solo_gain + gain
        self.solo_nodes = decay * self.solo_nodes + nodes
        self.solo_ms = decay * self.solo_ms + seconds * 1e3
        self.solo_weight = decay * self.solo_weight + 1.0

    def observe_gate(self, gain: int, nodes: int, seconds: float) -> None:
        """tree+lookup: an iteration that ran the drafter beside a chain accepted `gain` nodes the chain
        did not have, verified `nodes` such nodes, and spent `seconds` drafting."""
        self.gate_iterations += 1
        self.gate_gain += gain
        self.gate_nodes += nodes
        self.gate_ms += seconds * 1e3

    def observe_other(self, seconds: float) -> None:
        self.other_ms = LOAD_DECAY * self.other_ms + seconds * 1e3
        self.other_weight = LOAD_DECAY * self.other_weight + 1.0

    def observe_lookup(self, kept: int, accepted: int, ngram: int = 0) -> None:
        """tree+lookup: the iteration verified the first `kept` tokens of a chain that followed an
        `ngram`-token match, and accepted `accepted` of them."""
        seen = self.lookup_drafted.setdefault(ngram, [])
        hits = self.lookup_accepted.setdefault(ngram, [])
        if kept > len(seen):
            hits += [0] * (kept - len(seen))
            seen += [0] * (kept - len(seen))
        for i in range(kept):
            seen[i] += 1
            hits[i] += i < accepted

    def observe(self, kept_scores: list[float], accepted: int, fixed_seconds: float) -> None:
        """After an iteration: the kept nodes' scores, how many nodes were accepted, and the iteration's
        seconds outside the target forward."""
        self.predicted += sum(math.exp(s) for s in kept_scores)
        self.accepted += accepted
        self.fixed_total_ms += fixed_seconds * 1e3
        self.iterations += 1
