"""Verifiers: pure tensor functions that accept a prefix of the draft(s) and emit one more token.

`get_verifier(name)` returns a chain or multi-draft verifier by name (see `base.py` for the calling
convention); `verify_tree` verifies a drafted token tree. docs/verifiers.md is the reference for the math.
"""

from . import chain, greedy_block, multidraft  # noqa: F401  (registration)
from .base import CROSS_ITERATION, SINGLE_DRAFT, VERIFIERS, Continuation, VerifyOutput, get_verifier
from .multidraft import greedy_token
from .randomness import Sampler, TorchSampler
from .tree import TREE_MODES, TokenTree, TreeVerifyOutput, greedy_path, verify_tree

__all__ = [
    "CROSS_ITERATION",
    "SINGLE_DRAFT",
    "TREE_MODES",
    "VERIFIERS",
    "Continuation",
    "Sampler",
    "TokenTree",
    "TorchSampler",
    "TreeVerifyOutput",
    "VerifyOutput",
    "get_verifier",
    "greedy_path",
    "greedy_token",
    "verify_tree",
]
