"""The loss contract for the real drafters: micro-batch 4 x accumulation 1, 2 x 2 and 1 x 4 give the same
gradients (`strategy.py`). SpecBlock's per-slot means over valid-prefix entries and its Rank Head's class
re-weighting both depend on counts that only the forward knows; a mean of micro-batch means would
differ. Tiny random float64 target and drafters, online teacher, rows of unequal lengths, two steps (the
second on updated weights), the valid-prefix curriculum half-way (alpha 0.5 at step 1) and a rank budget
small enough to re-weight."""

import pytest
import torch
from accelerate import Accelerator

from specblock.train.batching import collate
from specblock.train.losses import CurriculumConfig, LossConfig
from specblock.train.optim import OptimConfig
from specblock.train.trainer import TrainerConfig, fit

from tiny_models import distill_strategy

ROWS, MAX_LEN, VOCAB = 8, 14, 48
CLIP = Accelerator.clip_grad_norm_
# float64 everywhere but inside HF's RMSNorm, which normalises in float32: SpecBlock's slot queries
# ([K, H], shared by every position) reach theirs with the whole micro-batch's gradient summed, so one
# float32 rounding per micro-batch (~3e-8 relative) separates the splits there; everything else agrees
# to ~1e-15. Tolerances are relative to each gradient's largest entry. A mean of micro-batch means is off by ~1e-2 or more.
RTOL = 1e-6
SPLITS = [(4, 1), (2, 2), (1, 4)]  # (micro-batch, accumulation): 4 rows per optimizer step


def rows() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    out = []
    for n in torch.randint(6, MAX_LEN + 1, (ROWS,), generator=g).tolist():
        loss_mask = torch.ones(n, dtype=torch.long)
        loss_mask[:3] = 0  # the prompt
        out.append({"input_ids": torch.randint(0, VOCAB, (n,), generator=g), "loss_mask": loss_mask})
    return out


def step_gradients(name, micro, accum, tmp_path, monkeypatch) -> list[list[torch.Tensor]]:
    """The gradients each optimizer step applies (read where the trainer clips them)."""
    seen = []

    def record(self, parameters, max_norm, norm_type=2):
        parameters = list(parameters)
        seen.append([p.grad.detach().clone() for p in parameters if p.grad is not None])
        return CLIP(self, parameters, max_norm, norm_type)

    monkeypatch.setattr(Accelerator, "clip_grad_norm_", record)
    loss = LossConfig(curriculum=CurriculumConfig(0, 2), rank_budget=2)
    strategy = distill_strategy(name, loss)
    cfg = TrainerConfig(
        output_dir=str(tmp_path / f"{name}-{micro}x{accum}"),
        max_steps=2,
        micro_batch_size=micro,
        grad_accum=accum,
        save_every=0,
        mixed_precision="no",
        optim=OptimConfig(lr=1e-2, warmup_steps=0, schedule="constant", grad_clip=0.0),
    )
    fit(strategy, rows(), lambda batch: collate(batch, pad_id=0), cfg)
    return seen


@pytest.mark.parametrize("name", ["specblock", "eagle3"])
def test_accumulation_splits_give_the_same_gradients(name, tmp_path, monkeypatch):
    runs = [step_gradients(name, micro, accum, tmp_path, monkeypatch) for micro, accum in SPLITS]
    reference = runs[0]
    assert len(reference) == 2 and all(g.abs().sum() > 0 for g in reference[1])
    for split, run in zip(SPLITS[1:], runs[1:]):
        for step, (got, expected) in enumerate(zip(run, reference)):
            for a, b in zip(got, expected):
                scale = float(b.abs().max())
                torch.testing.assert_close(
                    a, b, rtol=RTOL, atol=RTOL * scale, msg=lambda m: f"{split}, {step}: {m}"
                )
