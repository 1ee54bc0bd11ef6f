"""Cost-aware serving-time adaptation: the drafter learns from verifier feedback while it serves.

    feedback.py  the buffer of verified positions and the served-data loss (pure)
    bandit.py    the cost-aware choice of what to update
    adapter.py   the arms, the update, the guards: what the decoding loop calls

docs/specblock.md 1.6: the authors' code keeps only hooks, so this is our design (README "Serving-time
adaptation" gives the rule and its parameters).

Supervision, free of any extra target forward (`Feedback`): every target forward of the decoding loop
(the prefill and each verification) already returns the target's features and logits at the positions
it commits. For each committed context position t the buffer keeps the features at t, the token after
t, and the target's argmax after t (its greedy label). Slot k at position t must predict the target's
choice after position t+1+k: that label, and whether the drafter's argmax got it (the valid prefix: no
loss after the first wrong slot), and the rank of the label in the draft distribution (the Rank Head's
class label) all follow from the buffer. Memory is bounded: a ring of `buffer_positions` positions.

Arms (`ARMS`): `none`; `rank_head` (SpecBlock's Rank Head); `last_layer` (the drafter's last decoder
layer and final norm); `lora` (a rank-r adapter on the draft LM head, W + B A with B = 0 at the start).
Which parameters an arm trains is the drafter's spec's (decoding/drafters.py: `arms`), except `lora`,
which every drafter has (its `lm_head`).
An update is `steps` Adam steps on the chosen subset over the buffered segments, timed.

Bandit (`CostAwareBandit`, one decision per window of `window` requests). With beta the tokens per
target call and c the seconds per target call measured on the last window, and N its tokens, an update
of arm a that lifts beta by d saves N c (1/beta - 1/(beta + d)) seconds over a window like the last one.
UCB1 on the lift: d_a = mean lift of a + ucb_c sqrt(ln n / n_a) (n: decisions so far; unexplored arms
are optimistic, d = `optimistic_lift`); the cost C_a is the mean measured update time of a (unexplored:
`cost_prior` seconds). The bandit picks argmax_a saved_a - C_a and updates only if that is > 0; else
`none`. The lift is measured at once, without serving: the newest request's feedback is held out of
the update, and the reward is the change of the mean accepted-prefix length (greedy labels, K slots)
that the verifier would have given the drafter's drafts on it, replayed before and after the update
(accepted draft tokens per position: the same units as tokens per target call). Window-level
acceptance is too noisy for this (two requests move it by +-0.1).

Guards: an update whose replayed lift is <= 0 is undone at once (never served); a served update is
reverted when the next window's tokens per target call fall below (1 - revert_margin) x the window
before. Both restore a snapshot of the drafter taken before the update.
Adaptation never touches verification, so the output law stays the target's whatever the drafter does.
"""

from .adapter import ARMS, AdaptConfig, Adapter, Event, LowRankHead, arm_parameters, available_arms
from .bandit import ArmStats, CostAwareBandit, Window
from .feedback import Feedback, Position, Segment, feedback_loss, slot_labels

__all__ = [
    "ARMS",
    "AdaptConfig",
    "Adapter",
    "ArmStats",
    "CostAwareBandit",
    "Event",
    "Feedback",
    "LowRankHead",
    "Position",
    "Segment",
    "Window",
    "arm_parameters",
    "available_arms",
    "feedback_loss",
    "slot_labels",
]
