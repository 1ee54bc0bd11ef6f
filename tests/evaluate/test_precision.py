"""target.dtype=auto on a CPU: the evaluation measures which precision decodes fastest (evaluate/precision.py)."""

from __future__ import annotations

import copy

import pytest
import torch

from specblock.data.embedded import ensure_embedded_target
from specblock.data.target import TINY_TARGET_DIR, TargetConfig
from specblock.evaluate import precision
from specblock.evaluate.config import EvalConfig
from specblock.evaluate.precision import choose_precision, needs_probe, probe_method
from specblock.evaluate.run import build, evaluate


def test_the_lower_median_wins_and_the_rounds_alternate():
    calls, times = [], {"bfloat16": iter([9.0, 1.0, 2.0]), "float32": iter([3.0, 3.0, 3.0])}

    def seconds(d):
        calls.append(d)
        return next(times[d]) / 1e3

    dtype, ms = choose_precision(seconds, ("bfloat16", "float32"), rounds=3)
    assert calls == ["bfloat16", "float32"] * 3  # a load spike hits both, not one precision's whole run
    assert ms == pytest.approx({"bfloat16": 2.0, "float32": 3.0}) and dtype == "bfloat16"  # 9 ms: an outlier


def test_the_probe_decodes_a_tree_when_there_is_one():
    assert probe_method(["autoregressive", "lookup", "chain-token", "tree"], ["eagle3", "specblock"]) == (
        "tree",
        "eagle3",
    )
    assert probe_method(["autoregressive", "chain-token"], ["specblock"]) == ("chain-token", "specblock")
    assert probe_method(["autoregressive", "lookup"], []) == ("lookup", None)
    assert probe_method(["autoregressive"], []) == ("autoregressive", None)


def test_only_auto_on_a_cpu_is_probed():
    auto_bf16 = TargetConfig(dtype="bfloat16", dtype_auto=True)  # auto, resolved to bf16 by the flags
    assert needs_probe(EvalConfig(target=auto_bf16, drafters={}, methods=["autoregressive"]))
    assert not needs_probe(EvalConfig(target=TargetConfig(dtype="bfloat16"), drafters={}, methods=["lookup"]))
    auto_f32 = TargetConfig(dtype="float32", dtype_auto=True)  # a CPU without bf16 kernels: nothing to weigh
    assert not needs_probe(EvalConfig(target=auto_f32, drafters={}, methods=["lookup"]))
    assert TargetConfig(dtype="auto").dtype_auto and not TargetConfig(dtype="float32").dtype_auto


@pytest.mark.parametrize("faster", ["float32", "bfloat16"])
def test_the_evaluation_decodes_in_the_precision_the_probe_measured_faster(tmp_path, monkeypatch, faster):
    """The probe decodes the first prompt in both precisions (each decoder's target in its own dtype); the
    whole evaluation then runs in the faster one: its records, the target it decodes with, and the float32
    reference of plain decoding only where the evaluation is not float32 itself."""
    seen = {}

    def fake_choose(seconds_per_token, candidates, rounds=precision.PROBE_ROUNDS):
        for d in candidates:
            seen[d] = seconds_per_token(d)  # the real probe decode, in that precision
        return faster, {d: 1.0 if d == faster else 2.0 for d in candidates}

    monkeypatch.setattr(precision, "choose_precision", fake_choose)
    copied, deepcopy = [], copy.deepcopy

    def counting_deepcopy(x, *args):
        if isinstance(x, torch.nn.Module):
            copied.append(type(x).__name__)
        return deepcopy(x, *args)

    monkeypatch.setattr(copy, "deepcopy", counting_deepcopy)
    ensure_embedded_target(TINY_TARGET_DIR)
    cfg = EvalConfig(
        output_dir=str(tmp_path / "eval"), drafters={}, methods=["autoregressive", "lookup"],
        target=TargetConfig(name_or_path=TINY_TARGET_DIR, dtype="bfloat16", dtype_auto=True),
        datasets=["humaneval"], local_root=None, limit=2, max_new_tokens=6,
    )  # fmt: skip
    setup = build(cfg)
    assert set(seen) == {"bfloat16", "float32"} and all(s > 0 for s in seen.values())
    assert cfg.target.dtype == faster and setup.model.dtype == getattr(torch, faster)
    assert setup.probe.method == "lookup" and setup.probe.dtype == faster
    labels = [label for label, _ in setup.runs]
    assert ("autoregressive@float32" in labels) == (faster == "bfloat16")
    assert len(copied) == 1  # the probe's float32 copy, which the float32 baseline reuses when bf16 wins

    cfg.output_dir = str(tmp_path / "eval2")
    cfg.target = TargetConfig(name_or_path=TINY_TARGET_DIR, dtype="bfloat16", dtype_auto=True)
    rows = evaluate(cfg)
    assert {r["dtype"] for r in rows} == {faster}
    assert all(r["precision_probe"]["method"] == "lookup" for r in rows)
    assert (
        f"Precision (target.dtype=auto): {faster}, measured here"
        in (tmp_path / "eval2" / "results.md").read_text()
    )


def test_the_report_says_how_auto_was_decided_without_a_probe():
    from specblock.evaluate.precision import PrecisionProbe, precision_note

    cpu32 = TargetConfig(dtype="float32", dtype_auto=True)
    assert "float32: bf16 matrix products are not faster" in precision_note(cpu32, None)
    gpu16 = TargetConfig(dtype="bfloat16", device="cuda", dtype_auto=True)
    assert "bfloat16: this GPU supports bf16" in precision_note(gpu16, None)
    assert precision_note(TargetConfig(dtype="float32"), None) == ""  # explicit: nothing to say
    probe = PrecisionProbe("float32", "tree", "specblock", {"bfloat16": 83.1, "float32": 70.4})
    assert "specblock:tree decoded the first prompt" in precision_note(cpu32, probe)
    assert "bfloat16 83.1, float32 70.4" in precision_note(cpu32, probe)
