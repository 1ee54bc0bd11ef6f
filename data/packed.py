"""Linear layers on a packed matrix product (`weight_layout=packed`): MKL's for float32, oneDNN's for
bfloat16, CPU decoding kernels.

A decoding step multiplies a few rows (1 token, or the nodes of a small tree) by every weight of the model.
MKL's ordinary sgemm re-packs the weight into its blocked layout inside every such call; `cblas_sgemm_pack`
does it once, and `cblas_sgemm_compute` then reads the packed copy (PyTorch exposes both as
`torch.ops.mkl._mkl_reorder_linear_weight` / `_mkl_linear`, what inductor's freezing uses on CPUs).

Measured on the Intel Xeon of sessions 11-15 (30 SmolLM2 layers' seven linears, float32, 2 threads,
medians): 1 / 2 / 4 / 8 / 16 / 32 rows in 24.6 / 28.4 / 43.3 / 54.7 / 61.3 / 75.2 ms plain against
22.4 / 24.7 / 27.1 / 34.7 / 41.8 / 54.5 packed; the 49k-row LM head over 8 rows 17.8 against 7.1 ms.
The packed copy's layout does not depend on the number of rows a call brings (PACK_ROWS only tunes it). On
that Xeon, for SmolLM2's shapes, the packed product is also row-wise the same whatever the number of rows (a
token's output bitwise the one it gets fed alone), where the plain kernel changes its rounding with the
number of rows below 16; nothing relies on it (tiny layers of one row differ), the loop's exactness does not
depend on the kernel.

bfloat16 has the same kind of kernel in oneDNN: `torch.ops.mkldnn._reorder_linear_weight` reorders a bf16
weight into oneDNN's blocked layout once, `_linear_pointwise` multiplies through it. F.linear on a bf16 CPU
tensor calls the same oneDNN product but reorders the weight inside every call. Measured on the AMD EPYC
of sessions 17-19 (AVX512-BF16, 2 threads): sixty 576 x 1536 products over 1 / 4 / 16 / 64 / 256 rows in
5.3 / 6.3 / 6.7 / 17.9 / 54.6 ms plain against 4.5 / 3.8 / 5.0 / 12.5 / 55.0 prepacked, outputs bitwise
equal; SmolLM2-135M's decoding step (one token after a 300-token cache, LM head included) 29.1 against
23.7 ms, the logits bitwise equal. Where float32's packed product only pays from 4 rows, bf16's pays from
one, so a bf16 PackedLinear takes 1 to MAX_ROWS rows.

`PackedLinear` is nn.Linear with that forward (set on a module by `pack_linears`, which swaps the class of
each nn.Linear in place: the same object, parameters and ties), for the dtypes `pack_linears` names (both
by default; `weight_layout=auto` packs only where it measured packing faster, data/hardware.py). The packed
copy is made on the first forward and again whenever the weight changes (its storage, version or dtype),
costs the weight's size once more, and is never saved, copied or moved: a deep copy or a dtype change
makes a new one, or none. Only a CPU forward without gradients takes the packed product: float32 over
MIN_ROWS to MAX_ROWS rows, bfloat16 over 1 to MAX_ROWS rows; anything else is plain F.linear.

The transposed product (`weight_layout=transposed`): float32 linears compute y = (W x^T)^T, the weight as
the left operand, `torch.mm(w, x.t())` with x^T a view, no copy of anything but the [rows, out] result: the
same product through another BLAS call (the operands swapped), which MKL serves far faster for a few rows on
some CPUs. Measured on the AVX2-only AMD EPYC of
sessions 33-38 (no packed bf16, float32 the only fast precision; 30 SmolLM2 layers' seven linears, 2
threads, medians of 9): 1 / 2 / 4 / 8 / 16 / 32 / 64 rows in 29.5 / 46.7 / 78.2 / 95.4 / 119 / 174 / 284 ms
through F.linear against 30.9 / 32.3 / 33.7 / 55.2 / 73.2 / 136 / 242 transposed (the 49k-row LM head over 4
rows 32.6 against 7.6 ms); SmolLM2-135M after a 300-token cache, 1 / 2 / 4 / 8 tokens: 81 / 121 / 162 / 212
ms row-major against 83 / 84 / 90 / 122 transposed: a 4-token forward costs 1.1x a one-token step instead of
2x. From 512 rows on it is slower (a prefill's, a capture's), and one row is a matrix-vector product either
way, so it takes TRANSPOSED_MIN_ROWS to TRANSPOSED_MAX_ROWS rows. Its results differ from F.linear's in the
last bits (another summation order), as the packed product's do. `weight_layout=auto` measures it beside
row-major and packed (data/hardware.py) and keeps it only where it is faster.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

PACK_ROWS = 64  # the rows the packed layout is tuned for; any number of rows is correct (module docstring)
MIN_ROWS = 4  # fewer rows take the plain product (measured: in the whole model it is faster for 1-3 rows)
MAX_ROWS = 256  # more rows too: a prefill's or a capture's products (the LM head over 512 rows: 190 ms
# packed against 170 plain; 64 rows: 18.7 against 24.9)
TRANSPOSED_MIN_ROWS = 2  # one row: a matrix-vector product whichever operand comes first
TRANSPOSED_MAX_ROWS = 128  # measured: 96 / 128 / 256 rows 17 / 5 / 5 % faster, 512 rows 3 % slower
TRANSPOSED_DTYPES = {"float32": torch.float32}  # the dtypes the transposed product serves (module docstring)


def packing_available() -> bool:
    """Whether this PyTorch build has MKL's packed product (x86 CPU builds do; others fall back)."""
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


def bf16_packing_available() -> bool:
    """Whether this PyTorch build and CPU have oneDNN's prepacked bf16 product (module docstring)."""
    ops = torch.ops.mkldnn
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(ops, "_linear_pointwise")
        and hasattr(ops, "_reorder_linear_weight")
        and bool(ops._is_mkldnn_bf16_supported())
    )


PACKED_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # the dtypes with a packed kernel
_ONEDNN_LINEAR = (
    getattr(torch.ops.mkldnn, "_linear_pointwise", None) if torch.backends.mkldnn.is_available() else None
)
_MKL_LINEAR = getattr(torch.ops.mkl, "_mkl_linear", None) if torch.backends.mkl.is_available() else None


def packable_dtypes() -> list[str]:
    """The names of the PACKED_DTYPES this build (and CPU) has a packed kernel for."""
    have = {"float32": packing_available(), "bfloat16": bf16_packing_available()}
    return [name for name in PACKED_DTYPES if have[name]]


def transposed_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, w, bias) as (w x^T)^T (module docstring): x [..., in], w [out, in] -> [..., out]."""
    rows = x.numel() // x.shape[-1]
    y = torch.mm(w, x.reshape(rows, x.shape[-1]).t()).t().contiguous()
    if bias is not None:
        y.add_(bias)
    return y.view(*x.shape[:-1], w.shape[0])


def weight_key(w: torch.Tensor) -> tuple:
    """What a packed copy was made from: the weight's storage, version, shape and strides."""
    return (w.data_ptr(), w._version, w.shape, w.stride())


class PackedLinear(torch.nn.Linear):
    """nn.Linear whose CPU inference forward reads a packed copy of the weight in the dtypes of `packs`, and
    takes the transposed product in the dtypes of `transposes` (module docstring)."""

    _pack: torch.Tensor | None = None
    _pack_key: tuple | None = None
    packs: frozenset = frozenset()  # the dtypes it packs: pack_linears sets them per layer
    transposes: frozenset = frozenset()  # the dtypes it multiplies as (W x^T)^T

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # a decoding forward calls this ~200 times: the parameters are read from the module's dict (not
        # through Module.__getattr__) and the tests cost a few attribute reads (~1 us against ~4 before)
        params = self._parameters
        w, bias, dtype = params["weight"], params["bias"], x.dtype
        packs = dtype in self.packs
        if not (packs or dtype in self.transposes) or dtype != w.dtype or not w.is_cpu:
            return F.linear(x, w, bias)
        if torch.is_grad_enabled() and (w.requires_grad or x.requires_grad):
            return F.linear(x, w, bias)
        rows = x.numel() // self.in_features
        if not packs:
            if TRANSPOSED_MIN_ROWS <= rows <= TRANSPOSED_MAX_ROWS:
                return transposed_linear(x, w, bias)
            return F.linear(x, w, bias)
        if rows > MAX_ROWS or (rows < MIN_ROWS and dtype is torch.float32):  # float32: 1-3 rows pay plain
            return F.linear(x, w, bias)
        pack = self._pack
        if pack is None or self._pack_key != weight_key(w):
            pack = self.packed_weight()
        if dtype is torch.bfloat16:  # oneDNN: any number of rows pays
            return _ONEDNN_LINEAR(x, pack, bias, "none", [], "")
        return _MKL_LINEAR(x, pack, w, bias, rows)

    def packed_weight(self) -> torch.Tensor:
        """The packed copy of the current weight (MKL's for float32, oneDNN's for bfloat16), made again
        when the weight changed since (its storage, version, shape or strides; a dtype change drops it)."""
        w = self.weight
        key = weight_key(w)
        if self._pack is None or self._pack_key != key:
            if w.dtype == torch.bfloat16:
                self._pack = torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous(), 1)
            else:
                self._pack = torch.ops.mkl._mkl_reorder_linear_weight(w.detach().contiguous(), PACK_ROWS)
            self._pack_key = key
        return self._pack

    def _apply(self, *args, **kwargs):  # .to(), .float(), .cuda(): the old copy would only hold memory
        self.__dict__.pop("_pack", None)
        self.__dict__.pop("_pack_key", None)
        return super()._apply(*args, **kwargs)

    def __getstate__(self) -> dict:  # deep copies and pickles leave the packed copy (an opaque MKL tensor)
        state = dict(super().__getstate__())
        state.pop("_pack", None)
        state.pop("_pack_key", None)
        return state


def pack_linears(
    module: torch.nn.Module,
    dtypes: list[str] | tuple[str, ...] | None = None,
    transposed: list[str] | tuple[str, ...] = (),
) -> int:
    """Every nn.Linear of `module` becomes a PackedLinear in place, packing in `dtypes` (names of
    PACKED_DTYPES; None: every one this build has a kernel for) and taking the transposed product in
    `transposed` (names of TRANSPOSED_DTYPES, not packed too); returns how many changed (a PackedLinear
    whose dtypes change counts too)."""
    have = packable_dtypes()
    names = have if dtypes is None else list(dtypes)
    if unknown := [d for d in names if d not in PACKED_DTYPES]:
        raise ValueError(
            f"no packed kernel for {unknown}: packed layouts exist for {', '.join(PACKED_DTYPES)}"
        )
    if unknown := [d for d in transposed if d not in TRANSPOSED_DTYPES or d in names]:
        raise ValueError(
            f"no transposed product for {unknown}: it serves {', '.join(TRANSPOSED_DTYPES)}, where not packed"
        )
    missing = [d for d in names if d not in have] if names or transposed else list(PACKED_DTYPES)
    if missing:
        kernels = {"float32": "MKL (x86 CPU builds have it)", "bfloat16": "oneDNN with bf16 on this CPU"}
        need = "; ".join(f"{d}: {kernels[d]}" for d in missing)
        raise RuntimeError(f"weight_layout=packed needs a packed kernel this build lacks ({need})")
    packs = frozenset(PACKED_DTYPES[d] for d in names)
    transposes = frozenset(TRANSPOSED_DTYPES[d] for d in transposed)
    changed = 0
    for mod in module.modules():
        if type(mod) is torch.nn.Linear or (
            type(mod) is PackedLinear and (mod.packs, mod.transposes) != (packs, transposes)
        ):
            mod.__class__ = PackedLinear
            mod.packs, mod.transposes = packs, transposes
            changed += 1
    return changed


def unpack_linears(module: torch.nn.Module) -> int:
    """Every PackedLinear of `module` becomes a plain nn.Linear again (its packed copy dropped)."""
    changed = 0
    for mod in module.modules():
        if type(mod) is PackedLinear:
            for name in ("_pack", "_pack_key", "packs", "transposes"):
                mod.__dict__.pop(name, None)
            mod.__class__ = torch.nn.Linear
            changed += 1
    return changed
