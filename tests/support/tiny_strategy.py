"""A tiny drafter strategy for trainer tests (`import tiny_strategy`), and the script
`test_distributed.py` launches:

`accelerate launch --config_file configs/accelerate/<cfg>.yaml tests/support/tiny_strategy.py OUT TYPE PRECISION`
runs, on every rank: an uninterrupted run, then a run that crashes after a checkpoint and resumes from
it; each rank writes `OUT/result_rank<r>.json` with what the test asserts.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch import nn

from specblock.data.world import shutdown_distributed
from specblock.train.checkpoint import find_latest, read_model_state
from specblock.train.optim import OptimConfig
from specblock.train.strategy import StepOutput
from specblock.train.trainer import TrainerConfig, fit

DIM, VOCAB, SEQ = 8, 16, 6
TEACHER_SEED = 1234


class Crash(RuntimeError):
    """Raised by TinyStrategy to simulate a run killed mid-way."""


class TinyStrategy:
    """An MLP drafter distilled (forward KL) from a frozen linear teacher on random features.

    Loss = mean KL over the masked positions, as the sum `kl` over them with their count `kl` (the
    trainer normalises over the whole step). Dropout draws from the global RNG, so resume tests also
    check that RNG state is restored.
    """

    def __init__(self, seed: int = 0, dropout: float = 0.0, crash_at_step: int | None = None):
        torch.manual_seed(TEACHER_SEED)  # the frozen target is the same in every run
        self.teacher = nn.Linear(DIM, VOCAB)
        torch.manual_seed(seed)  # the drafter's initialisation
        self.module = nn.Sequential(nn.Linear(DIM, 32), nn.Dropout(dropout), nn.ReLU(), nn.Linear(32, VOCAB))
        self.crash_at_step = crash_at_step
        self.losses: list[float] = []  # per micro-batch loss sums (numerators), in order
        self.calls = 0  # extra state, checkpointed through state_dict

    def loss_counts(self, batch, step, epoch):
        return {"kl": batch["mask"].sum()}  # known from the batch: no forward

    def loss(self, sums, counts):
        return sums["kl"] / counts["kl"].clamp_min(1)

    def num_tokens(self, batch):
        return batch["mask"].numel()

    def forward_loss(self, batch, step, epoch):
        if step == self.crash_at_step:
            raise Crash(f"simulated crash at step {step}")
        with torch.no_grad():
            target = self.teacher(batch["x"]).float().log_softmax(-1)  # [B, T, V]
        draft = self.module(batch["x"]).float().log_softmax(-1)  # [B, T, V]
        kl = (target.exp() * (target - draft)).sum(-1)  # [B, T]
        mask = batch["mask"]
        loss = (kl * mask).sum()
        hits = ((draft.argmax(-1) == target.argmax(-1)) & mask.bool()).sum()
        self.losses.append(loss.item())
        self.calls += 1
        self.seen = {"teacher": type(self.teacher).__name__, "input_dtype": str(batch["x"].dtype)}
        metrics = {"acc/sum": hits, "acc/count": mask.sum(), "scalar/data_epoch": torch.tensor(epoch)}
        return StepOutput({"kl": loss}, self.loss_counts(batch, step, epoch), metrics)

    def state_dict(self):
        return {"calls": self.calls}

    def load_state_dict(self, state):
        self.calls = state["calls"]


def make_dataset(n: int = 24, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    """n rows of x [SEQ, DIM] with a mask of random length (so micro-batches hold unequal counts)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, SEQ + 1, (n,), generator=g)
    return [
        {"x": torch.randn(SEQ, DIM, generator=g), "mask": (torch.arange(SEQ) < int(k)).float()}
        for k in lengths
    ]


def collate(rows):
    return {key: torch.stack([r[key] for r in rows]) for key in rows[0]}


def tiny_config(output_dir, **overrides) -> TrainerConfig:
    base = dict(
        output_dir=str(output_dir),
        max_steps=6,
        micro_batch_size=2,
        grad_accum=2,
        save_every=2,
        keep_last=2,
        log_every=1,
        mixed_precision="no",
        optim=OptimConfig(lr=1e-2, warmup_steps=2, schedule="cosine", grad_clip=1.0),
    )
    return TrainerConfig(**{**base, **overrides})


def main(out: Path, expected_type: str, mixed_precision: str) -> None:
    from accelerate.state import AcceleratorState

    def config(name, **overrides):
        return tiny_config(out / name, mixed_precision=mixed_precision, **overrides)

    full = TinyStrategy(dropout=0.1)
    fit(full, make_dataset(), collate, config("full"))
    state = AcceleratorState()
    crashed = TinyStrategy(dropout=0.1, crash_at_step=3)
    try:
        fit(crashed, make_dataset(), collate, config("resume"))
    except Crash:
        pass
    resumed = TinyStrategy(dropout=0.1, seed=123)  # different init: everything must come from the checkpoint
    fit(resumed, make_dataset(), collate, config("resume", resume="latest"))
    fit(TinyStrategy(), make_dataset(), collate, config("equiv"))  # no dropout: compared with one process
    a, b = read_model_state(find_latest(out / "full")), read_model_state(find_latest(out / "resume"))
    start = 2 * 2  # the resumed run restarts at the step-2 checkpoint: 2 steps x grad_accum 2 micro-batches
    result = {
        "num_processes": state.num_processes,
        "distributed_type": str(state.distributed_type),
        "losses_full": full.losses,
        "losses_crashed": crashed.losses,
        "losses_resumed": resumed.losses,
        "resume_matches": full.losses[start:] == resumed.losses
        and full.losses[:start] == crashed.losses[:start],
        "params_equal": sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a),
        "checkpoints": sorted(p.name for p in (out / "resume").iterdir()),
        **resumed.seen,
    }
    assert state.num_processes == 2, state.num_processes
    assert expected_type in result["distributed_type"], result["distributed_type"]
    (out / f"result_rank{state.process_index}.json").write_text(json.dumps(result, indent=1))
    shutdown_distributed()  # as `python -m specblock.train` ends


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], sys.argv[3])
