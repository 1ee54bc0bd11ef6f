"""The training loop on a tiny strategy, one CPU process: schedules, accumulation equivalence,
bit-exact resume, atomic checkpoints, trackers."""

import logging
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from specblock.train import checkpoint as ckpt
from specblock.train.optim import OptimConfig, build_optimizer, build_scheduler, lr_factor
from specblock.train.strategy import DrafterStrategy
from specblock.train.tracking import (
    NullTracker,
    is_main,
    log0,
    make_tracker,
    redact_secrets,
    settle_wandb_mode,
    wandb_credentials,
)
from specblock.train.checkpoint import EpochSampler
from specblock.train.trainer import TrainerConfig, fit

import tiny_strategy as tiny  # tests/support


def params(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


# ---- schedules and optimizer -------------------------------------------------------------------


@pytest.mark.parametrize(
    "schedule, min_ratio, expected",
    [  # warmup 2 of 10 steps: 0.5, 1 at steps 0, 1; then decay over steps 2..10 (progress (s-2)/8)
        ("cosine", 0.0, {0: 0.5, 1: 1.0, 2: 1.0, 6: 0.5, 10: 0.0, 12: 0.0}),
        ("cosine", 0.1, {2: 1.0, 6: 0.55, 10: 0.1}),
        ("linear", 0.0, {0: 0.5, 2: 1.0, 4: 0.75, 6: 0.5, 10: 0.0}),
        ("constant", 0.0, {0: 0.5, 1: 1.0, 9: 1.0}),
    ],
)
def test_lr_factor_values(schedule, min_ratio, expected):
    cfg = OptimConfig(warmup_steps=2, schedule=schedule, min_lr_ratio=min_ratio)
    for step, value in expected.items():
        assert lr_factor(step, 10, cfg) == pytest.approx(value), step


def test_scheduler_drives_optimizer_lr():
    cfg = OptimConfig(lr=0.1, warmup_steps=0, schedule="linear")
    opt = build_optimizer(nn.Linear(2, 2), cfg)
    sched = build_scheduler(opt, cfg, total_steps=4)
    seen = []
    for _ in range(4):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([0.1, 0.075, 0.05, 0.025])


def test_weight_decay_only_on_matrices():
    opt = build_optimizer(nn.Sequential(nn.Linear(3, 3), nn.LayerNorm(3)), OptimConfig(weight_decay=0.1))
    decays = {tuple(p.shape): g["weight_decay"] for g in opt.param_groups for p in g["params"]}
    assert decays == {(3, 3): 0.1, (3,): 0.0}


@pytest.mark.parametrize(
    "bad", [dict(schedule="step"), dict(betas=(0.9, 1.0)), dict(min_lr_ratio=2.0), dict(lr=0.0)]
)
def test_optim_config_rejects(bad):
    with pytest.raises(ValueError):
        OptimConfig(**bad)


@pytest.mark.parametrize(
    "bad",
    [
        dict(),
        dict(max_steps=2, epochs=1.0),
        dict(max_steps=2, mixed_precision="fp8"),
        dict(max_steps=2, logger="tensorboard"),
        dict(max_steps=2, grad_accum=0),
        dict(max_steps=2, max_minutes=-1.0),
        dict(max_steps=2, max_minutes=float("nan")),
    ],
)
def test_trainer_config_rejects(bad, tmp_path):
    with pytest.raises(ValueError):
        TrainerConfig(output_dir=str(tmp_path), **bad)


@pytest.mark.parametrize("save_every", [25, 0])
def test_milestones_that_are_never_saved_are_refused(save_every, tmp_path):
    cfg = TrainerConfig(output_dir=str(tmp_path), max_steps=2, save_every=save_every, keep_every=40)
    with pytest.raises(ValueError, match="keep_every=40 must be a multiple of save_every"):
        cfg.check_milestones()  # fit() calls it before anything else
    TrainerConfig(output_dir=str(tmp_path), max_steps=2, save_every=20, keep_every=40).check_milestones()


def test_epoch_sampler_is_seeded_and_starts_midway():
    s = EpochSampler(10, seed=3)
    first = list(s)
    assert list(s) == first and sorted(first) == list(range(10))
    s.set_epoch(1)
    second = list(s)
    assert second != first
    s.start = 4
    assert list(s) == second[4:] and len(s) == 6


def test_length_grouped_sampler_batches_similar_lengths_and_resumes():
    lengths = torch.randint(1, 500, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    s = EpochSampler(64, seed=3, lengths=lengths, group=4, batch=4)
    order = list(s)
    assert sorted(order) == list(range(64)) and list(s) == order  # a seeded permutation
    batches = [[lengths[i] for i in order[b : b + 4]] for b in range(0, 64, 4)]
    spread = sum(max(b) - min(b) for b in batches)
    plain = list(EpochSampler(64, seed=3))
    plain_spread = sum(
        max(lengths[i] for i in plain[b : b + 4]) - min(lengths[i] for i in plain[b : b + 4])
        for b in range(0, 64, 4)
    )
    assert spread < plain_spread / 2  # far less padding per micro-batch
    assert [max(b) for b in batches] != sorted((max(b) for b in batches), reverse=True)  # still shuffled
    s.start = 12
    assert list(s) == order[12:]  # resume mid-epoch replays the same order
    s.set_epoch(1)
    assert list(s) != order


# ---- the loop ----------------------------------------------------------------------------------


def test_tiny_strategy_satisfies_protocol():
    assert isinstance(tiny.TinyStrategy(), DrafterStrategy)


def test_grad_accum_equivalence(tmp_path):
    """micro-batch 4 x accumulation 1 == 2 x 2 == 1 x 4: same data, same updates (to float error).

    Masks have random lengths, so a mean of micro-batch means would fail this test."""
    finals, losses = [], []
    for mb, ga in [(4, 1), (2, 2), (1, 4)]:
        strategy = tiny.TinyStrategy()
        cfg = tiny.tiny_config(tmp_path / f"mb{mb}", micro_batch_size=mb, grad_accum=ga, save_every=0)
        fit(strategy, tiny.make_dataset(), tiny.collate, cfg)
        finals.append(params(strategy.module))
        losses.append(torch.tensor(strategy.losses).view(6, ga).sum(1))  # loss sum per optimizer step
    for other, other_losses in zip(finals[1:], losses[1:]):
        for key in finals[0]:
            torch.testing.assert_close(other[key], finals[0][key], atol=1e-6, rtol=0)
        torch.testing.assert_close(other_losses, losses[0], atol=1e-5, rtol=1e-6)


def test_resume_is_bit_exact(tmp_path):
    """Crash after the step-6 checkpoint (an epoch end), resume="latest": same losses and parameters.

    24 rows / micro-batch 2 = 12 micro-batches = 6 steps per epoch; dropout tests the RNG restore."""
    cfg = dict(max_steps=9, save_every=3, keep_last=2)
    full = tiny.TinyStrategy(dropout=0.1)
    fit(full, tiny.make_dataset(), tiny.collate, tiny.tiny_config(tmp_path / "full", **cfg))

    out = tmp_path / "crashed"
    crashed = tiny.TinyStrategy(dropout=0.1, crash_at_step=7)
    with pytest.raises(tiny.Crash):
        fit(crashed, tiny.make_dataset(), tiny.collate, tiny.tiny_config(out, **cfg))
    assert [p.name for p in ckpt.list_checkpoints(out)] == ["step_000003", "step_000006"]
    assert ckpt.read_meta(out / "step_000006")["batch_in_epoch"] == 12

    resumed = tiny.TinyStrategy(dropout=0.1, seed=99)  # different init: all must come from the checkpoint
    metrics = fit(resumed, tiny.make_dataset(), tiny.collate, tiny.tiny_config(out, resume="latest", **cfg))
    assert metrics["step"] == 9 and metrics["train/epoch"] == 1.5
    assert resumed.losses == full.losses[12:]  # 6 steps x 2 micro-batches done before the checkpoint
    assert crashed.losses[:14] == full.losses[:14]
    assert resumed.calls == full.calls  # the strategy's extra state came back too
    final, expected = params(resumed.module), params(full.module)
    assert all(torch.equal(final[k], expected[k]) for k in expected)
    assert [p.name for p in ckpt.list_checkpoints(out)] == ["step_000006", "step_000009"]


def test_max_minutes_stops_saves_and_resumes_bit_exact(tmp_path, monkeypatch, caplog):
    """A fake clock makes every step last 30 s: a 1.25-minute budget stops after step 3 (1.5 min) with
    its checkpoint saved; a resume with the same budget trains nothing; a larger one goes on as if the
    run had never stopped (the LR schedule follows max_steps, not the budget)."""
    from specblock.train import trainer

    now = [0.0]

    def clock():  # _train_step reads it twice a step: start and end, 30 s apart
        now[0] += 30.0
        return now[0]

    full = tiny.TinyStrategy(dropout=0.1)
    fit(full, tiny.make_dataset(), tiny.collate, tiny.tiny_config(tmp_path / "full", save_every=0))

    monkeypatch.setattr(trainer, "_clock", clock)
    caplog.set_level(logging.INFO, logger="specblock.train")
    out = tmp_path / "budget"
    stopped = tiny.TinyStrategy(dropout=0.1)
    metrics = fit(stopped, tiny.make_dataset(), tiny.collate, tiny.tiny_config(out, max_minutes=1.25))
    assert metrics["step"] == 3 and "train/loss" in metrics
    assert stopped.losses == full.losses[:6]  # 3 steps x 2 micro-batches
    assert [p.name for p in ckpt.list_checkpoints(out)] == ["step_000002", "step_000003"]
    assert ckpt.read_meta(out / "step_000003")["train_ms"] == 90_000
    assert any("max_minutes=1.25 reached" in r.getMessage() for r in caplog.records)

    caplog.clear()
    idle = tiny.TinyStrategy(dropout=0.1)
    metrics = fit(
        idle, tiny.make_dataset(), tiny.collate, tiny.tiny_config(out, max_minutes=1.25, resume="latest")
    )
    assert metrics["step"] == 3 and idle.losses == []
    assert any("is spent at step 3" in r.getMessage() for r in caplog.records)

    resumed = tiny.TinyStrategy(dropout=0.1, seed=99)
    metrics = fit(
        resumed, tiny.make_dataset(), tiny.collate, tiny.tiny_config(out, max_minutes=10, resume="latest")
    )
    assert metrics["step"] == 6 and resumed.losses == full.losses[6:]
    final, expected = params(resumed.module), params(full.module)
    assert all(torch.equal(final[k], expected[k]) for k in expected)


def test_milestone_checkpoints_survive_pruning(tmp_path):
    cfg = tiny.tiny_config(tmp_path, max_steps=8, save_every=1, keep_last=2, keep_every=3)
    fit(tiny.TinyStrategy(), tiny.make_dataset(), tiny.collate, cfg)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == [
        "step_000003",
        "step_000006",
        "step_000007",
        "step_000008",
    ]


def test_resume_from_explicit_path_and_missing(tmp_path):
    fit(tiny.TinyStrategy(), tiny.make_dataset(), tiny.collate, tiny.tiny_config(tmp_path / "a", max_steps=2))
    s = tiny.TinyStrategy()
    cfg = tiny.tiny_config(tmp_path / "b", max_steps=3, resume=str(tmp_path / "a" / "step_000002"))
    assert fit(s, tiny.make_dataset(), tiny.collate, cfg)["step"] == 3 and len(s.losses) == 2
    with pytest.raises(FileNotFoundError, match="step_000042"):
        ckpt.resolve_resume(str(tmp_path / "a" / "step_000042"), tmp_path)


def test_crash_during_save_leaves_no_checkpoint(tmp_path, monkeypatch):
    from accelerate import Accelerator

    real_save = Accelerator.save_state

    def broken_save(self, output_dir=None, **kwargs):
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        (Path(output_dir) / "model.safetensors").write_bytes(b"half-written")
        raise OSError("disk full")

    monkeypatch.setattr(Accelerator, "save_state", broken_save)
    with pytest.raises(OSError, match="disk full"):
        fit(tiny.TinyStrategy(), tiny.make_dataset(), tiny.collate, tiny.tiny_config(tmp_path, max_steps=2))
    assert [p.name for p in tmp_path.iterdir()] == [".tmp_step_000002"]
    assert ckpt.find_latest(tmp_path) is None

    monkeypatch.setattr(Accelerator, "save_state", real_save)
    cfg = tiny.tiny_config(tmp_path, max_steps=2, resume="latest")  # nothing to resume: starts fresh
    assert fit(tiny.TinyStrategy(), tiny.make_dataset(), tiny.collate, cfg)["step"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000002"]  # the stale .tmp_ is gone


def test_exported_weights_are_unwrapped_and_final(tmp_path):
    s = tiny.TinyStrategy()
    fit(s, tiny.make_dataset(), tiny.collate, tiny.tiny_config(tmp_path, max_steps=2))
    stored = ckpt.read_model_state(ckpt.find_latest(tmp_path))
    assert set(stored) == set(s.module.state_dict())
    assert all(torch.equal(stored[k], v) for k, v in s.module.state_dict().items())
    assert s.teacher.weight.requires_grad is False and not s.teacher.training


def test_epochs_sets_the_step_count(tmp_path):
    """24 rows / (micro-batch 2 x accumulation 2) = 6 steps per epoch."""
    cfg = tiny.tiny_config(tmp_path, max_steps=None, epochs=1.5, save_every=0)
    metrics = fit(tiny.TinyStrategy(), tiny.make_dataset(), tiny.collate, cfg)
    assert metrics["step"] == 9 and metrics["train/epoch"] == 1.5


def test_strategy_metric_names_may_not_shadow_trainer_metrics(tmp_path):
    class Shadowing(tiny.TinyStrategy):
        def forward_loss(self, batch, step, epoch):
            out = super().forward_loss(batch, step, epoch)
            out.metrics["scalar/lr"] = torch.tensor(1.0)
            return out

    with pytest.raises(ValueError, match="lr"):
        fit(Shadowing(), tiny.make_dataset(), tiny.collate, tiny.tiny_config(tmp_path, max_steps=1))


def test_strategy_metrics_are_global_ratios(tmp_path):
    s = tiny.TinyStrategy()
    metrics = fit(s, tiny.make_dataset(), tiny.collate, tiny.tiny_config(tmp_path, max_steps=2, log_every=2))
    assert set(metrics) >= {
        "train/loss",
        "train/acc",
        "train/lr",
        "train/grad_norm",
        "train/tokens_per_s",
        "train/peak_mem_gib",
        "train/epoch",
        "train/tokens_seen",
        "train/data_epoch",
        "step",
    }
    assert metrics["train/tokens_seen"] == 2 * 2 * 2 * tiny.SEQ  # steps x accumulation x micro-batch x length
    assert 0.0 <= metrics["train/acc"] <= 1.0 and metrics["train/peak_mem_gib"] > 0


# ---- trackers ----------------------------------------------------------------------------------


def test_logger_none_never_imports_wandb(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` now raises ImportError
    assert isinstance(make_tracker("none"), NullTracker)
    cfg = tiny.tiny_config(tmp_path, max_steps=2)
    assert fit(tiny.TinyStrategy(), tiny.make_dataset(), tiny.collate, cfg)["step"] == 2


def test_wandb_offline_run_has_logged_keys(tmp_path, monkeypatch):
    for var, sub in [
        ("WANDB_DIR", "wandb_dir"),
        ("WANDB_CACHE_DIR", "cache"),
        ("WANDB_CONFIG_DIR", "config"),
        ("WANDB_DATA_DIR", "data"),
    ]:
        monkeypatch.setenv(var, str(tmp_path / sub))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = tiny.tiny_config(tmp_path / "run", max_steps=2, logger="wandb", run_name="tiny-run")
    fit(
        tiny.TinyStrategy(),
        tiny.make_dataset(),
        tiny.collate,
        cfg,
        run_config={"trainer": {"micro_batch_size": 2}, "hub_token": "hf_SECRET_VALUE"},
    )
    runs = list((tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1
    # protobuf records: keys and the config are stored as plain strings. wandb's service process may
    # still be writing them after finish() returns on a loaded machine: wait for the summary record.
    deadline = time.monotonic() + 30
    while b"tiny-run" not in (blob := runs[0].read_bytes()) or b"train/acc" not in blob:
        if time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for key in [
        "train/loss",
        "train/lr",
        "train/tokens_per_s",
        "train/peak_mem_gib",
        "train/acc",
        "tiny-run",
        "micro_batch_size",
    ]:
        assert key.encode() in blob, key
    assert b"hf_SECRET_VALUE" not in blob


def test_redact_secrets():
    cfg = {
        "wandb_api_key": "x",
        "l": [{"password": 1}],
        "a": {"HF_TOKEN": "y", "pad_token": "<pad>", "max_tokens": 3},
    }
    assert redact_secrets(cfg) == {
        "wandb_api_key": "<redacted>",
        "l": [{"password": "<redacted>"}],
        "a": {"HF_TOKEN": "<redacted>", "pad_token": "<pad>", "max_tokens": 3},
    }


def test_only_rank_zero_logs(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="specblock.train")
    monkeypatch.setenv("RANK", "1")
    assert not is_main()
    log0("from rank 1")
    monkeypatch.setenv("RANK", "0")
    log0("from rank 0")
    assert [r.getMessage() for r in caplog.records] == ["from rank 0"]


def _netrc(path: Path, host: str) -> Path:
    path.write_text(f"machine {host}\n  login user\n  password {'x' * 40}\n")
    path.chmod(0o600)  # netrc refuses a readable password file owned by the user
    return path


def test_wandb_credentials_are_found_where_wandb_looks_without_prompting(tmp_path):
    assert wandb_credentials({"WANDB_API_KEY": "k", "NETRC": str(tmp_path / "none")}) == "WANDB_API_KEY"
    assert wandb_credentials({"NETRC": str(tmp_path / "none")}) is None  # no file
    rc = _netrc(tmp_path / "rc", "api.wandb.ai")
    assert wandb_credentials({"NETRC": str(rc)}) == str(rc)
    # another server: its host's entry counts, api.wandb.ai's does not
    assert wandb_credentials({"NETRC": str(rc), "WANDB_BASE_URL": "https://wandb.corp.example"}) is None
    corp = _netrc(tmp_path / "corp", "wandb.corp.example")
    assert wandb_credentials({"NETRC": str(corp), "WANDB_BASE_URL": "https://wandb.corp.example"}) == str(
        corp
    )
    (tmp_path / "bad").write_text("machine\n")  # malformed: no key from it, and no crash
    assert wandb_credentials({"NETRC": str(tmp_path / "bad")}) is None


def test_a_wandb_run_without_a_key_logs_offline_instead_of_failing(tmp_path):
    none = str(tmp_path / "no-netrc")
    env = {"NETRC": none}
    line = settle_wandb_mode("wandb", tmp_path / "run", env)
    assert env["WANDB_MODE"] == "offline"
    assert str(tmp_path / "run" / "wandb") in line and "wandb sync" in line and "WANDB_MODE=online" in line
    for kind, given in [
        ("none", {"NETRC": none}),  # no W&B at all
        ("wandb", {"NETRC": none, "WANDB_MODE": "online"}),  # the user's choice stays
        ("wandb", {"NETRC": none, "WANDB_API_KEY": "k"}),  # a key: online, as wandb would
    ]:
        before = dict(given)
        assert settle_wandb_mode(kind, tmp_path, given) is None and given == before
