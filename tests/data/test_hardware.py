"""bf16 autocast where bf16 matrix products are measured faster (data/hardware.py), kept per machine."""

from __future__ import annotations

import json

import pytest
import torch

from specblock.data import hardware
from specblock.data.target import TargetConfig, auto_dtype
from specblock.train.accel import resolve_mixed_precision


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    """A private cache folder and no decision remembered from an earlier call in this process."""
    monkeypatch.setenv(hardware.CACHE_ENV, str(tmp_path))
    for decision in (hardware.bf16_matmul_pays, hardware.column_major_pays):
        decision.cache_clear()
    yield tmp_path
    for decision in (hardware.bf16_matmul_pays, hardware.column_major_pays):
        decision.cache_clear()


def fake_times(monkeypatch, ms: dict[str, float]) -> list[int]:
    calls = []
    monkeypatch.setattr(hardware, "matmul_ms", lambda: calls.append(1) or dict(ms))
    return calls


def test_the_measured_faster_precision_decides_and_is_kept_for_the_machine(fresh, monkeypatch):
    monkeypatch.setattr(hardware, "has_bf16_kernels", lambda: True)  # the flags allow bf16
    calls = fake_times(monkeypatch, {"float32": 24.0, "bfloat16": 32.0})  # this Xeon's numbers
    assert not hardware.bf16_matmul_pays() and calls == [1]
    assert resolve_mixed_precision("auto") == "no" and auto_dtype("cpu") == "float32"
    kept = json.loads((fresh / "bf16_matmul.json").read_text())
    assert list(kept.values()) == [{"float32": 24.0, "bfloat16": 32.0}]
    assert hardware.cpu_model() in next(iter(kept))

    hardware.bf16_matmul_pays.cache_clear()  # a new process (another rank, a later run) on the machine
    calls = fake_times(monkeypatch, {"float32": 24.0, "bfloat16": 8.0})
    assert not hardware.bf16_matmul_pays() and calls == []  # read back, not measured again

    (fresh / "bf16_matmul.json").write_text("{not json")  # damaged: measured again
    hardware.bf16_matmul_pays.cache_clear()
    assert hardware.bf16_matmul_pays() and calls == [1]
    assert resolve_mixed_precision("auto") == "bf16" and resolve_mixed_precision("no") == "no"
    assert auto_dtype("cpu") == "bfloat16" and TargetConfig(dtype="auto").dtype == "bfloat16"


def test_without_bf16_kernels_nothing_is_measured(fresh, monkeypatch):
    monkeypatch.setattr(hardware, "has_bf16_kernels", lambda: False)
    calls = fake_times(monkeypatch, {"float32": 24.0, "bfloat16": 1.0})
    assert not hardware.bf16_matmul_pays() and calls == []
    assert not (fresh / "bf16_matmul.json").exists()


def test_the_probe_times_both_precisions(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text(
        "processor : 0\nmodel name\t: Some CPU @ 2.0GHz\nflags\t\t: fpu sse avx2 avx512f avx512_bf16\n"
    )
    assert hardware.cpu_flags(str(info)) == {"fpu", "sse", "avx2", "avx512f", "avx512_bf16"}
    assert hardware.cpu_flags(str(tmp_path / "missing")) == set()
    assert hardware.has_bf16_kernels({"avx512f", "avx512_bf16"}) and hardware.has_bf16_kernels({"amx_bf16"})
    assert not hardware.has_bf16_kernels({"avx2", "avx512f"})
    assert hardware.cpu_model(str(info)) == "Some CPU @ 2.0GHz"
    ms = hardware.matmul_ms(rounds=1, shape=(8, 16, 8))
    assert set(ms) == {"float32", "bfloat16"} and all(v > 0 for v in ms.values())
    assert hardware.cpu_model(str(tmp_path / "missing")) == "unknown"


def test_nowhere_to_keep_it_still_decides(fresh, monkeypatch, caplog):
    """A cache folder that cannot be made (here: a file stands there): measured for this process only."""
    blocker = fresh / "not_a_folder"
    blocker.write_text("")
    monkeypatch.setenv(hardware.CACHE_ENV, str(blocker / "sub"))
    monkeypatch.setattr(hardware, "has_bf16_kernels", lambda: True)
    calls = fake_times(monkeypatch, {"float32": 24.0, "bfloat16": 8.0})
    assert hardware.bf16_matmul_pays() and calls == [1]
    assert "cannot keep the measurement" in caplog.text


# ---------------------------------------------------------------- weight layout (decoding)


class TiedLM(torch.nn.Module):
    """An embedding, a hidden linear layer and an LM head tied to the embedding."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(11, 6)
        self.hidden = torch.nn.Linear(6, 6)
        self.head = torch.nn.Linear(6, 11, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.hidden(self.embed(ids))))


def test_column_layout_keeps_values_parameters_and_ties():
    torch.manual_seed(0)
    model, ids = TiedLM(), torch.tensor([[1, 5, 7, 10]])
    before, params = model(ids), list(model.parameters())
    assert hardware.set_weight_layout(model, "column") == 2  # the tied weight once
    assert model.hidden.weight.t().is_contiguous() and not model.hidden.weight.is_contiguous()
    assert model.head.weight is model.embed.weight and model.embed.weight.t().is_contiguous()
    assert list(model.parameters()) == params  # the same Parameter objects, only their storage moved
    torch.testing.assert_close(model(ids), before)
    assert hardware.set_weight_layout(model, "column") == 0  # already so
    assert hardware.set_weight_layout(model, "row") == 2 and model.hidden.weight.is_contiguous()
    torch.testing.assert_close(model(ids), before)
    with pytest.raises(ValueError, match="weight_layout='diagonal'"):
        hardware.set_weight_layout(model, "diagonal")


def test_the_measured_faster_layout_decides_on_a_cpu_and_is_kept(fresh, monkeypatch):
    calls = []
    monkeypatch.setattr(hardware, "layout_ms", lambda: calls.append(1) or {"row": 3.0, "column": 2.0})
    assert hardware.auto_layout("cuda:0") == "row" and calls == []  # nothing to measure on a GPU
    assert hardware.auto_layout("cpu") == "column" and calls == [1]
    kept = json.loads((fresh / "linear_layout.json").read_text())
    assert list(kept.values()) == [{"row": 3.0, "column": 2.0}]
    hardware.column_major_pays.cache_clear()
    monkeypatch.setattr(hardware, "layout_ms", lambda: calls.append(1) or {"row": 1.0, "column": 2.0})
    assert hardware.auto_layout("cpu") == "column" and calls == [1]  # read back, not measured again
    (fresh / "linear_layout.json").unlink()
    hardware.column_major_pays.cache_clear()
    assert hardware.auto_layout("cpu") == "row" and calls == [1, 1]


def test_the_layout_probe_times_both_layouts():
    ms = hardware.layout_ms(rounds=1, rows=(1, 2), shapes=((8, 16), (16, 8)))
    assert set(ms) == {"row", "column"} and all(v > 0 for v in ms.values())
