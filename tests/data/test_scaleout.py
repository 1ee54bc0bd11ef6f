"""The data stage split over ranks, in one process: each rank is simulated by a World whose barrier does
nothing, the ranks run one after another and rank 0 last (what the real barrier guarantees before rank 0
merges). Checked against a single process: the same regenerated.jsonl bytes, the same feature shards; a
rank killed mid-way resumes from its own part. tests/data/test_data_launch.py runs it for real."""

import json

import pytest
import torch

from tiny_models import Interrupting

from specblock.data import regenerate as regen
from specblock.data.capture import CaptureConfig, capture_features
from specblock.data.errors import BadInputError
from specblock.data.manifest import read_manifest
from specblock.data.regenerate import RegenerateConfig, part_path, part_paths, regenerate
from specblock.data.target import FeatureTarget
from specblock.data.world import World, launched_world, shutdown_distributed

CONVS = [(f"c{i}", [{"role": "user", "content": "what is the cat " * (1 + i % 3)}]) for i in range(7)]
CFG = RegenerateConfig(max_new_tokens=4, batch_size=2, temperature=0.8)  # batches {0,1} {2,3} {4,5} {6}


def test_world_deals_units_round_robin_and_places_ranks_on_their_gpu(monkeypatch):
    assert [u for u in range(7) if World(1, 3).owns(u)] == [1, 4]
    assert World().owns(5) and World().is_main and not World(2, 3).is_main
    assert World(1, 2, local_rank=1).device("cuda") == "cuda:1"
    assert World(1, 2).device("cuda:3") == "cuda:3" and World().device("cuda") == "cuda"
    with pytest.raises(ValueError, match="rank < size"):
        World(2, 2)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert launched_world() == World()  # a plain process: rank 0 of 1, no process group


def lines(path):
    return path.read_bytes().splitlines(keepends=True)


def test_shutdown_ends_the_process_group_and_is_a_no_op_without_one(tmp_path):
    """`python -m specblock.train` / `specblock.data` end their rank's process group after a finished run
    (a rank exiting with it alive could abort in gloo's teardown and fail the launch); a plain run has none."""
    import torch.distributed as dist

    shutdown_distributed()  # no group: nothing happens
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    assert dist.is_initialized()
    shutdown_distributed()
    assert not dist.is_initialized()


def test_ranks_regenerate_their_batches_and_rank0_merges_the_one_process_file(tiny_chat, tmp_path):
    model, tok = tiny_chat
    single = regenerate(model, tok, CONVS, tmp_path / "one" / "r.jsonl", CFG)
    out = tmp_path / "two" / "r.jsonl"
    assert regenerate(model, tok, CONVS, out, CFG, World(1, 2)) == []  # only rank 0 returns the rows
    assert [json.loads(x)["id"] for x in lines(part_path(out, 1))] == ["c2", "c3", "c6"]
    assert not out.exists()
    assert regenerate(model, tok, CONVS, out, CFG, World(0, 2)) == single
    assert out.read_bytes() == (tmp_path / "one" / "r.jsonl").read_bytes()  # same batches, seeds, bytes
    assert part_paths(out) == []


def test_a_killed_rank_resumes_from_its_part(tiny_chat, tmp_path, monkeypatch):
    model, tok = tiny_chat
    reference = regenerate(model, tok, CONVS, tmp_path / "one" / "r.jsonl", CFG)
    out, real, calls = tmp_path / "two" / "r.jsonl", regen.generate_batch, []

    def dying(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # killed in rank 1's second batch
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(regen, "generate_batch", dying)
    with pytest.raises(KeyboardInterrupt):
        regenerate(model, tok, CONVS, out, CFG, World(1, 2))
    with open(part_path(out, 1), "a") as f:
        f.write('{"id": "c6", "tu')  # a write cut by the kill
    calls.clear()
    regenerate(model, tok, CONVS, out, CFG, World(1, 2))
    assert len(calls) == 1  # only batch {6} was left
    monkeypatch.setattr(regen, "generate_batch", real)
    assert regenerate(model, tok, CONVS, out, CFG, World(0, 2)) == reference
    assert out.read_bytes() == (tmp_path / "one" / "r.jsonl").read_bytes()


def test_ranks_resume_a_one_process_file_and_one_process_resumes_ranks(tiny_chat, tmp_path):
    model, tok = tiny_chat
    one = tmp_path / "one" / "r.jsonl"
    reference = regenerate(model, tok, CONVS, one, CFG)
    # a single-process run killed after two batches (like the committed cpu_full file), resumed by 2 ranks
    out = tmp_path / "two" / "r.jsonl"
    out.parent.mkdir()
    out.write_bytes(b"".join(lines(one)[:4]))
    for rank in (1, 0):
        regenerate(model, tok, CONVS, out, CFG, World(rank, 2))
    assert out.read_bytes() == one.read_bytes()
    # two ranks killed (rank 0 never ran), resumed by one process: it takes over rank 0's batches only
    back = tmp_path / "back" / "r.jsonl"
    regenerate(model, tok, CONVS, back, CFG, World(1, 2))
    assert regenerate(model, tok, CONVS, back, CFG) == reference
    assert sorted(lines(back)) == sorted(lines(one)) and part_paths(back) == []


def test_ranks_capture_their_shards_resume_and_rank0_writes_one_manifest(tiny_chat, tmp_path):
    model, tok = tiny_chat
    target = FeatureTarget(model, target_id="tiny")
    g = torch.Generator().manual_seed(0)
    rows = []
    for n in torch.randint(3, 12, (8,), generator=g).tolist():
        rows.append(
            {"input_ids": torch.randint(0, len(tok), (n,), generator=g).tolist(), "loss_mask": [1] * n}
        )
    cfg = CaptureConfig(batch_size=2, shard_rows=2)  # 4 shards, one forward each; rank 1 owns 1 and 3
    single = capture_features(target, rows, tmp_path / "one", cfg, tokenizer=tok)
    out = tmp_path / "two"
    with pytest.raises(BadInputError, match="features-00001.safetensors: this shard is missing"):
        capture_features(target, rows, out, cfg, tokenizer=tok, world=World(0, 2))  # rank 1 never ran
    with pytest.raises(KeyboardInterrupt):
        capture_features(Interrupting(target, stop_at=2), rows, out, cfg, tokenizer=tok, world=World(1, 2))
    assert sorted(p.name for p in out.iterdir()) == [f"features-0000{s}.safetensors" for s in (0, 1, 2)]
    resumed = Interrupting(target)
    capture_features(resumed, rows, out, cfg, tokenizer=tok, world=World(1, 2))
    assert resumed.calls == 1 and not (out / "manifest.json").exists()  # shard 3 only; rank 0 writes it
    rank0 = Interrupting(target)
    capture_features(rank0, rows, out, cfg, tokenizer=tok, world=World(0, 2))
    assert rank0.calls == 0  # its shards 0 and 2 were written before rank 1's turn came
    assert read_manifest(out).shards == read_manifest(single).shards  # every shard, in order, same bytes
    assert read_manifest(out).num_samples == 8
