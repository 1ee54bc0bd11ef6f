"""Real `accelerate launch` runs of the trainer with 2 CPU processes: DDP, ZeRO-2 (bf16), ZeRO-3.

Each launch runs tests/support/tiny_strategy.py: an uninterrupted run, a run that crashes after its
step-4 checkpoint and resumes from it, and a dropout-free run compared here with one process
(2 ranks x micro-batch 2 x accumulation 2 == 1 rank x micro-batch 4 x accumulation 2).
Seconds per launch on 2 shared cores: ~7 (DDP), ~10 (ZeRO-2/3), +~30 for DeepSpeed's first JIT build
of its comm op (cached in TORCH_EXTENSIONS_DIR, default <repo>/.cache/torch_extensions; needs ninja).
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specblock.train.checkpoint import find_latest, read_model_state
from specblock.train.trainer import fit

import tiny_strategy as tiny

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # real launches: 12-25 s each

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "support" / "tiny_strategy.py"
ACCELERATE = Path(sys.executable).with_name("accelerate")
LAUNCH_TIMEOUT_S = 300  # a launch takes 7-40 s here; leave room for a loaded machine
# config -> (expected distributed type, precision, environment that makes it run on CPU)
CASES = {
    "ddp": ("MULTI_CPU", "no", {"ACCELERATE_USE_CPU": "true"}),
    "zero2": ("DEEPSPEED", "bf16", {"DS_ACCELERATOR": "cpu"}),
    "zero3": ("DEEPSPEED", "no", {"DS_ACCELERATOR": "cpu"}),
}


def free_port() -> int:
    with socket.socket() as s:  # other test sessions may launch at the same time: never use 29500
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(config: str, out: Path, expected_type: str, precision: str, extra_env: dict) -> list[dict]:
    env = {**os.environ, **extra_env, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))
    config_file = REPO / "configs" / "accelerate" / f"{config}.yaml"
    cmd = [
        str(ACCELERATE),
        "launch",
        "--config_file",
        str(config_file),
        "--num_processes",
        "2",
        "--main_process_port",
        str(free_port()),
        str(WORKER),
        str(out),
        expected_type,
        precision,
    ]
    proc = subprocess.run(
        cmd, cwd=out.parent, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S
    )
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return [json.loads((out / f"result_rank{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.parametrize("config", list(CASES))
def test_launch_resume_and_equivalence(config, tmp_path):
    expected_type, precision, extra_env = CASES[config]
    out = tmp_path / "out"
    results = launch(config, out, expected_type, precision, extra_env)
    for res in results:
        assert res["num_processes"] == 2  # the worker asserts it too
        assert res["resume_matches"], (res["losses_full"], res["losses_crashed"], res["losses_resumed"])
        assert res["params_equal"]  # bit-identical final weights after crash + resume
        assert res["checkpoints"] == ["step_000004", "step_000006"]  # keep_last=2, no .tmp_ left
        assert res["input_dtype"] == ("torch.bfloat16" if precision == "bf16" else "torch.float32")
        assert res["teacher"] == ("DeepSpeedEngine" if expected_type == "DEEPSPEED" else "Linear")
    assert results[0]["losses_full"] != results[1]["losses_full"]  # the ranks saw different data

    if precision == "no":  # one process with the same effective batch takes the same steps
        single = tiny.TinyStrategy()
        cfg = tiny.tiny_config(tmp_path / "single", micro_batch_size=4)
        fit(single, tiny.make_dataset(), tiny.collate, cfg)
        launched = read_model_state(find_latest(out / "equiv"))
        for key, value in single.module.state_dict().items():
            torch.testing.assert_close(launched[key], value, atol=1e-5, rtol=0)
