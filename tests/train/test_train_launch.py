"""`accelerate launch -m specblock.train` for real: 2 CPU processes, DDP and DeepSpeed ZeRO-2 and ZeRO-3
(gloo), on a tiny random target saved to disk; each run trains, checkpoints and exports a drafter that
loads. Accumulation 2: the trainer's count pass (the later micro-batch's loss counts, without gradients)
runs through the DDP / DeepSpeed wrappers of the real drafters."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from specblock.train.export import load_drafter

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # real launches: 12-25 s each
REPO = Path(__file__).resolve().parents[2]
ACCELERATE = Path(sys.executable).with_name("accelerate")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# config -> (environment that makes it run on CPU, distributed type the trainer reports)
LAUNCHES = {
    "ddp": ({"ACCELERATE_USE_CPU": "true"}, "MULTI_CPU"),
    "zero2": ({"DS_ACCELERATOR": "cpu"}, "DEEPSPEED"),
    "zero3": ({"DS_ACCELERATOR": "cpu"}, "DEEPSPEED"),
}


@pytest.mark.parametrize("zero", sorted(LAUNCHES))
def test_accelerate_launch_trains_on_two_cpu_processes(zero, tiny_chat, tmp_path):
    model, tok = tiny_chat
    model.save_pretrained(tmp_path / "target")
    tok.save_pretrained(tmp_path / "target")
    rows = [
        {
            "id": str(i),
            "conversations": [
                {"from": "human", "value": "what is the cat"},
                {"from": "gpt", "value": "the cat sat on the mat " * (1 + i % 3)},
            ],
        }
        for i in range(16)
    ]
    (tmp_path / "corpus.json").write_text(json.dumps(rows))
    out = tmp_path / "run"
    cmd = [
        str(ACCELERATE),
        "launch",
        "--config_file",
        str(REPO / "configs/accelerate" / f"{zero}.yaml"),
        "--main_process_port",
        str(free_port()),
        "-m",
        "specblock.train",
        "experiment=debug",
        f"data.target.name_or_path={tmp_path / 'target'}",
        f"data.corpus.source={tmp_path / 'corpus.json'}",
        f"data.out_dir={tmp_path / 'data'}",
        f"output_dir={out}",
        "drafter.draft_vocab_size=24",
        "drafter.rank_hidden=16",
        "trainer.max_steps=4",
        "trainer.micro_batch_size=2",
        "trainer.grad_accum=2",
        "trainer.save_every=2",
        "trainer.log_every=1",
    ]
    extra_env, kind = LAUNCHES[zero]
    env = {**os.environ, **extra_env, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"training on 2 process(es), {kind}" in done.stdout + done.stderr
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("step_")) == [
        "step_000002",
        "step_000004",
    ]
    drafter, config = load_drafter(out / "drafter")
    assert config["block_size"] == 4 and sum(p.numel() for p in drafter.parameters()) > 0
