"""Tiny drafters over tiny Llama targets for the modeling tests (test_modeling.py, test_drafting_paths.py)."""

import torch

from specblock.train.drafters import build_drafter
from specblock.train.modeling import Eagle3Config, SpecBlockConfig

from tiny_models import tiny_llama

# Two target shapes: (hidden, heads, kv heads, layers, vocab).
SHAPES = {"h32": (32, 4, 2, 2, 100), "h48": (48, 6, 2, 6, 90)}
B, T = 2, 6
ATOL = 1e-5


def make_target(hidden, heads, kv, layers, vocab, seed=0):
    return tiny_llama(
        vocab, seed=seed, hidden=hidden, layers=layers, heads=heads, kv_heads=kv, tie_word_embeddings=False
    )


def make(name, shape="h32", d2t=None, seed=0, **cfg_kwargs):
    """(drafter in eval mode, target model, features [B,T,3H], aligned ids [B,T])."""
    target = make_target(*SHAPES[shape], seed=seed)
    cfg = SpecBlockConfig(**cfg_kwargs) if name == "specblock" else Eagle3Config(**cfg_kwargs)
    drafter = build_drafter(
        name,
        cfg,
        target.config,
        target.get_input_embeddings().weight,
        target.get_output_embeddings().weight,
        d2t,
    ).eval()
    H, V = target.config.hidden_size, target.config.vocab_size
    return drafter, target, torch.randn(B, T, 3 * H), torch.randint(0, V, (B, T))


def perturbed_fusion(drafter, where, calls=(0,)):
    """Forward hook adding noise to the fused slot inputs x[:, t, k] for (t, k) in `where`, on the
    listed calls of the fusion module only (call 0 = block 1)."""
    count = [0]

    def hook(module, args, out):
        i, count[0] = count[0], count[0] + 1
        if i not in calls:
            return out
        out = out.clone()
        for t, k in where:
            out[:, t, k] += torch.randn_like(out[:, t, k])
        return out

    return drafter.fusion.register_forward_hook(hook)


def same(a, b):
    return torch.allclose(a, b, atol=ATOL, rtol=0)
