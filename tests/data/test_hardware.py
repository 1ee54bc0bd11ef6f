"""bf16 autocast where bf16 matrix products are measured faster (data/hardware.py), kept per machine."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from specblock.data import hardware
from specblock.data import packed
from specblock.data.packed import PackedLinear, bf16_packing_available, pack_linears, packing_available
from specblock.data.target import TargetConfig, auto_dtype
from specblock.train.accel import resolve_mixed_precision


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    """A private cache folder and no decision remembered from an earlier call in this process."""
    monkeypatch.setenv(hardware.CACHE_ENV, str(tmp_path))
    for decision in (hardware.bf16_matmul_pays, hardware.fastest_layout):
        decision.cache_clear()
    yield tmp_path
    for decision in (hardware.bf16_matmul_pays, hardware.fastest_layout):
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
    ms = {
        torch.float32: {"row": 3.0, "packed": 2.5, "transposed": 2.8},
        torch.bfloat16: {"row": 2.0, "packed": 2.5},
    }
    monkeypatch.setattr(hardware, "packable_dtypes", lambda: ["float32", "bfloat16"])

    def probe(**kw):
        calls.append(kw["dtype"])
        assert kw["rows"] == (
            hardware.BF16_LAYOUT_ROWS if kw["dtype"] == torch.bfloat16 else hardware.LAYOUT_ROWS
        )
        return dict(ms[kw["dtype"]])

    monkeypatch.setattr(hardware, "layout_ms", probe)
    assert hardware.auto_layout("cuda:0") == "row" and calls == []  # nothing to measure on a GPU
    assert hardware.auto_layout("cpu") == "packed-float32" and calls == [torch.float32, torch.bfloat16]
    kept = json.loads((fresh / "linear_layouts_float32.json").read_text())
    assert list(kept.values()) == [ms[torch.float32]]  # each precision in its own file
    assert list(json.loads((fresh / "linear_layouts_bfloat16.json").read_text()).values()) == [
        ms[torch.bfloat16]
    ]
    hardware.fastest_layout.cache_clear()
    ms[torch.float32] = {"row": 1.0, "packed": 2.0, "transposed": 3.0}
    assert (
        hardware.auto_layout("cpu") == "packed-float32" and len(calls) == 2
    )  # read back, not measured again
    for f in fresh.glob("linear_layouts*.json"):
        f.unlink()
    hardware.fastest_layout.cache_clear()
    assert hardware.auto_layout("cpu") == "row" and len(calls) == 4
    for fp32, tr, bf16, layout in (
        (2.5, 3.5, 2.5, "packed"),
        (3.5, 3.5, 2.5, "packed-bfloat16"),
        (3.5, 3.5, 3.5, "row"),
        (2.5, 2.0, 3.5, "transposed"),  # the fastest of the three float32 kernels
        (2.5, 2.0, 2.5, "transposed+packed-bfloat16"),
    ):
        for f in fresh.glob("linear_layouts*.json"):
            f.unlink()
        hardware.fastest_layout.cache_clear()
        ms = {
            torch.float32: {"row": 3.0, "packed": fp32, "transposed": tr},
            torch.bfloat16: {"row": 3.0, "packed": bf16},
        }
        assert hardware.auto_layout("cpu") == layout
    monkeypatch.setattr(hardware, "packable_dtypes", lambda: ["bfloat16"])  # a build without MKL
    (fresh / "linear_layouts_bfloat16.json").unlink()
    hardware.fastest_layout.cache_clear()
    ms[torch.float32] = {"row": 3.0, "packed": 1.0, "transposed": 3.5}  # a kept packed time is not a kernel
    (fresh / "linear_layouts_float32.json").write_text(json.dumps({next(iter(kept)): ms[torch.float32]}))
    n = len(calls)
    assert hardware.auto_layout("cpu") == "packed-bfloat16" and calls[n:] == [torch.bfloat16]  # float32 kept
    (fresh / "linear_layouts_float32.json").unlink()
    monkeypatch.setattr(hardware, "packable_dtypes", lambda: [])  # no packed kernel at all: float32 is still
    hardware.fastest_layout.cache_clear()  # weighed, row-major against transposed
    ms[torch.float32] = {"row": 3.0, "transposed": 2.0}
    assert hardware.auto_layout("cpu") == "transposed" and calls[-1] == torch.float32


def test_the_layout_probe_times_the_layouts_auto_weighs_or_any_others():
    ms = hardware.layout_ms(rounds=1, rows=(1, 4), shapes=((8, 16), (16, 8)), layers=2, head=(8, 32))
    assert set(ms) == set(hardware.AUTO_LAYOUTS) == {"row", "packed", "transposed"}
    assert all(v > 0 for v in ms.values())
    ms = hardware.layout_ms(
        rounds=1, rows=(4,), shapes=((8, 16),), layers=1, layouts=hardware.WEIGHT_LAYOUTS, head=None
    )
    # float32 weights: packed-bfloat16 packs nothing, the combination is the transposed layout
    assert set(ms) == set(hardware.WEIGHT_LAYOUTS) - {"packed-bfloat16", "transposed+packed-bfloat16"}


needs_mkl = pytest.mark.skipif(not packing_available(), reason="this PyTorch build has no MKL packed product")


@pytest.mark.parametrize("layout", ["packed", "transposed"])
def test_kernel_layouts_keep_values_parameters_and_ties(layout):
    """`packed` (MKL's packed copy) and `transposed` ((W x^T)^T) swap each nn.Linear's class in place: the same
    values, parameters and ties; `row` makes them plain linears again."""
    if layout == "packed" and not packing_available():
        pytest.skip("this PyTorch build has no MKL packed product")
    torch.manual_seed(0)
    model, ids = TiedLM(), torch.tensor([[1, 5, 7, 10]])
    before, params = model(ids), list(model.parameters())
    assert hardware.set_weight_layout(model, layout) == 2
    assert all(type(m) is PackedLinear for m in (model.hidden, model.head))
    assert model.head.weight is model.embed.weight and list(model.parameters()) == params
    packs = frozenset(packed.PACKED_DTYPES[d] for d in packed.packable_dtypes())
    want = (packs, frozenset()) if layout == "packed" else (frozenset(), frozenset({torch.float32}))
    assert (model.head.packs, model.head.transposes) == want
    with torch.no_grad():
        torch.testing.assert_close(model(ids), before)
        assert (model.hidden._pack is not None) == (layout == "packed")  # the packed product ran
    pack = model.hidden._pack
    assert hardware.set_weight_layout(model, layout) == 0 and model.hidden._pack is pack  # already so
    assert hardware.set_weight_layout(model, "row") == 2 and type(model.hidden) is torch.nn.Linear
    assert not {"_pack", "packs", "transposes"} & set(model.hidden.__dict__)
    with torch.no_grad():
        torch.testing.assert_close(model(ids), before)


def test_layout_names_say_what_each_precision_takes():
    assert hardware.layout_transposes("transposed+packed-bfloat16") == ["float32"]
    assert hardware.layout_dtypes("transposed+packed-bfloat16") == ["bfloat16"]
    assert hardware.layout_dtypes("transposed") == [] and hardware.layout_transposes("packed") == []
    assert hardware.layout_dtypes("packed") is None and hardware.layout_dtypes("packed-float32") == [
        "float32"
    ]
    for fp32, bf16 in (("row", False), ("packed", True), ("transposed", True), ("transposed", False)):
        name = hardware.layout_name(fp32, bf16)
        assert name in hardware.WEIGHT_LAYOUTS and hardware.layout_transposes(name) == ["float32"] * (
            fp32 == "transposed"
        )


@needs_mkl
def test_a_packed_linear_takes_any_number_of_rows():
    """One packed copy serves every number of rows (its layout is tuned for PACK_ROWS, not bound to it)."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(96, 80)
    x = torch.randn(40, 96)
    with torch.no_grad():
        plain = lin(x)
        pack_linears(lin)
        full = lin(x)
        torch.testing.assert_close(full, plain)
        for m in (1, 2, 3, 5, 8, 17, 40):
            torch.testing.assert_close(lin(x[:m]), plain[:m])
        torch.testing.assert_close(lin(x.view(4, 10, 96)), full.view(4, 10, 80))  # any leading shape


@needs_mkl
def test_a_packed_linear_follows_its_weight_and_falls_back_where_it_cannot_pack():
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 8)
    pack_linears(lin)
    x = torch.randn(4, 16)
    with torch.no_grad():
        lin(x)
        first = lin._pack
        lin.weight.mul_(2)  # an in-place update: packed again
        torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, lin.weight, lin.bias))
        assert lin._pack is not first
    y = lin(x.requires_grad_())  # with gradients: the plain product, differentiable
    y.sum().backward()
    assert lin.weight.grad is not None and x.grad is not None
    twin = copy.deepcopy(lin)  # the opaque packed copy stays behind and is made again
    assert type(twin) is PackedLinear and twin._pack is None
    with torch.no_grad():  # a prefill's many rows, and one token's row: the plain product
        twin(torch.randn(packed.MAX_ROWS + 1, 16))
        twin(torch.randn(1, 16))
    assert twin._pack is None
    assert lin._pack is not None
    half = lin.to(torch.bfloat16)  # in place: the float32 copy is dropped, not kept alive
    assert half is lin and lin._pack is None
    pack_linears(half, ["float32"])  # packing float32 only: bf16 takes plain F.linear
    with torch.no_grad():
        out = half(x.detach().bfloat16())
    assert out.dtype == torch.bfloat16 and half._pack is None


def test_the_transposed_product_is_f_linear_for_any_rows_shape_and_bias():
    """weight_layout=transposed (data/packed.py): float32 forwards over 2 to TRANSPOSED_MAX_ROWS rows
    compute (W x^T)^T, F.linear's values up to rounding; one row, more rows, bf16 and gradients take F.linear."""
    torch.manual_seed(0)
    for bias in (True, False):
        lin = torch.nn.Linear(96, 80, bias=bias)
        n = packed.TRANSPOSED_MAX_ROWS + 1
        x = torch.randn(n, 96)
        with torch.no_grad():
            plain = lin(x)
            assert pack_linears(lin, [], ["float32"]) == 1 and lin.transposes == frozenset({torch.float32})
            for m in (1, 2, 3, 8, 17, n - 1, n):
                torch.testing.assert_close(lin(x[:m]), plain[:m])
            torch.testing.assert_close(lin(x[:40].view(4, 10, 96)), plain[:40].view(4, 10, 80))
            torch.testing.assert_close(lin(x[:40].t().contiguous().t()), plain[:40])  # a non-contiguous input
            assert lin(x[:8]).is_contiguous()
            assert torch.equal(lin(x[:1]), torch.nn.functional.linear(x[:1], lin.weight, lin.bias))
            assert lin._pack is None  # nothing packed
        y = lin(x[:8].requires_grad_())  # with gradients: the plain product, differentiable
        y.sum().backward()
        assert lin.weight.grad is not None
    calls = []
    real = packed.transposed_linear
    try:
        packed.transposed_linear = lambda *a: calls.append(a[0].shape) or real(*a)
        with torch.no_grad():
            lin(x[:4])
            lin(x[:1])
            lin(x)  # TRANSPOSED_MAX_ROWS + 1 rows: plain
            half = copy.deepcopy(lin).bfloat16()  # bf16: plain, bitwise F.linear's
            xb = x[:4].bfloat16()
            assert torch.equal(half(xb), torch.nn.functional.linear(xb, half.weight, half.bias))
    finally:
        packed.transposed_linear = real
    assert calls == [torch.Size([4, 96])]
    with pytest.raises(ValueError, match="no transposed product for"):
        pack_linears(lin, [], ["bfloat16"])


needs_bf16_pack = pytest.mark.skipif(
    not bf16_packing_available(), reason="no oneDNN bf16 packed product here"
)


@needs_bf16_pack
def test_a_bf16_packed_linear_takes_any_number_of_rows_even_one():
    """oneDNN's packed bf16 product: the same values as F.linear (bitwise on the CPUs we measured; bf16
    rounding allowed), from one row up, any leading shape, with and without a bias."""
    torch.manual_seed(0)
    for bias in (True, False):
        lin = torch.nn.Linear(96, 80, bias=bias).bfloat16()
        x = torch.randn(40, 96).bfloat16()
        with torch.no_grad():
            plain = lin(x)
            assert pack_linears(lin, ["bfloat16"]) == 1 and lin.packs == frozenset({torch.bfloat16})
            assert lin._pack is None
            for m in (1, 2, 3, 17, 40):
                torch.testing.assert_close(lin(x[:m]), plain[:m])
            assert lin._pack is not None  # one row took the packed product
            torch.testing.assert_close(lin(x.view(4, 10, 96)), plain.view(4, 10, 80))
            torch.testing.assert_close(lin(x.t().contiguous().t()), plain)  # a non-contiguous input
            lin.weight.mul_(2)  # an in-place update: packed again
            torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, lin.weight, lin.bias))
        y = lin(x.float().requires_grad_().bfloat16())  # with gradients: the plain product
        y.float().sum().backward()
        assert lin.weight.grad is not None


@needs_bf16_pack
@needs_mkl
def test_packed_layouts_pack_the_precisions_they_name():
    torch.manual_seed(0)
    model, x32 = TiedLM(), torch.randn(4, 6)
    assert hardware.set_weight_layout(model, "packed-bfloat16") == 2
    with torch.no_grad():
        model.hidden(x32)
        assert model.hidden._pack is None  # float32 is not packed by this layout
        model.bfloat16()
        before = model.hidden(x32.bfloat16())
        assert model.hidden._pack is not None
    assert hardware.set_weight_layout(model, "packed-bfloat16") == 0  # already so
    assert hardware.set_weight_layout(model, "packed") == 2 and model.hidden.packs == set(
        packed.PACKED_DTYPES.values()
    )
    assert hardware.set_weight_layout(model, "packed-float32") == 2
    with torch.no_grad():
        torch.testing.assert_close(model.hidden(x32.bfloat16()), before)  # plain again, the same values
    assert hardware.set_weight_layout(model, "row") == 2 and "packs" not in model.hidden.__dict__
    with pytest.raises(ValueError, match="no packed kernel for"):
        pack_linears(model, ["float16"])


@needs_bf16_pack
def test_the_layout_probe_measures_bf16_packing():
    ms = hardware.layout_ms(
        rounds=1, rows=(1, 4), shapes=((8, 16),), layers=1, head=None, dtype=torch.bfloat16,
        layouts=hardware.WEIGHT_LAYOUTS,
    )  # fmt: skip
    assert set(ms) == {"row", "column", "packed", "packed-bfloat16"}  # packed-float32 packs nothing here
