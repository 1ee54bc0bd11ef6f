"""`accelerate launch -m specblock.data` for real: 2 CPU processes (gloo) on a tiny random target saved
to disk. A launch killed mid-regeneration, then resumed; the merged regenerated.jsonl, the token shards
and the feature shards equal a one-process run's row for row (the same bytes)."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from tiny_models import save_chat_data

from specblock.data.capture import load_feature_rows
from specblock.data.config import register_configs
from specblock.data.logs import ALL_RANKS_ENV
from specblock.data.manifest import read_manifest
from specblock.data.prepare import prepare
from specblock.data.shards import TokenDataset

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # real launches: 12-25 s each
REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("data_worker.py")
ACCELERATE = Path(sys.executable).with_name("accelerate")
LAUNCH_TIMEOUT_S = 300  # a launch takes ~15 s here; leave room for a loaded machine
BATCH = 2  # conversations per regeneration batch; batches are dealt to the ranks round-robin


def free_port() -> int:
    with socket.socket() as s:  # other test sessions may launch at the same time: never use 29500
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    # every rank's messages: the test reads rank 1's account of its resumed share
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1", ALL_RANKS_ENV: "1"}
    cmd = [str(ACCELERATE), "launch", "--config_file", str(REPO / "configs/accelerate/ddp.yaml")]
    cmd += ["--num_processes", "2", "--main_process_port", str(free_port()), *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)


@pytest.fixture()
def overrides(tiny_chat, tmp_path):
    save_chat_data(tiny_chat, tmp_path, ["what is the cat " * (1 + i % 4) for i in range(11)], "the cat sat")
    return [
        "target=tiny_random",
        f"data.target.name_or_path={tmp_path / 'target'}",
        f"data.corpus.source={tmp_path / 'corpus.json'}",
        "data.corpus.limit=null",
        "data.max_length=64",
        "data.shard_rows=4",
        "data.regenerate.max_new_tokens=4",
        f"data.regenerate.batch_size={BATCH}",
        "data.regenerate.temperature=0.7",  # sampled: seeds must follow the batches too
        "data.features.enabled=true",
        "data.features.shard_rows=3",
        "data.features.batch_size=2",
        "data.features.max_length=64",
        "data.features.dtype=float16",
    ]


def test_two_processes_killed_then_resumed_equal_one_process(overrides, tmp_path):
    register_configs()
    with initialize_config_module("specblock.configs", version_base=None):
        one = OmegaConf.to_object(
            compose("prepare", overrides=[*overrides, f"data.out_dir={tmp_path / 'one'}"])
        )
    single = prepare(one.data)

    two = tmp_path / "two"
    killed = launch([str(WORKER), "1", "2", *overrides, f"data.out_dir={two}"], tmp_path)
    assert killed.returncode != 0 and "killed in regeneration batch 2" in killed.stdout + killed.stderr
    part = [json.loads(line)["id"] for line in (two / "regenerated.rank1.jsonl").read_text().splitlines()]
    assert part == ["r2", "r3"]  # rank 1's first batch, whole; nothing merged, no shards
    assert not (two / "regenerated.jsonl").exists() and not (two / "tokens").exists()

    done = launch(["-m", "specblock.data", *overrides, f"data.out_dir={two}"], tmp_path)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-6000:]
    assert "regenerate, rank 1 of 2: 2 of 5 conversations already done" in log
    assert (two / "regenerated.jsonl").read_bytes() == (tmp_path / "one/regenerated.jsonl").read_bytes()
    assert sorted(p.name for p in two.glob("regenerated*")) == ["regenerated.jsonl"]  # parts merged, gone

    ours, theirs = TokenDataset(two / "tokens"), TokenDataset(single.tokens_dir)
    assert len(ours) == len(theirs) == single.num_rows
    for a, b in zip(ours, theirs):
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
    features, reference = read_manifest(two / "features"), read_manifest(single.features_dir)
    assert features.shards == reference.shards  # every shard, in row order, with the same sha256
    assert features.num_samples == reference.num_samples == single.num_rows
    for shard in features.shards:
        for a, b in zip(
            load_feature_rows(two / "features" / shard.file),
            load_feature_rows(single.features_dir / shard.file),
        ):
            assert a["row_index"] == b["row_index"] and torch.equal(a["features"], b["features"])
