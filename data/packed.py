"""Linear layers on MKL's packed matrix product (`weight_layout=packed`): a CPU decoding kernel.

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

`PackedLinear` is nn.Linear with that forward (set on a module by `pack_linears`, which swaps the class of
each nn.Linear in place: the same object, parameters and ties). The packed copy is made on the first
forward and again whenever the weight changes (its storage or version), costs the weight's size once more,
and is never saved, copied or moved: a deep copy or a dtype change makes a new one, or none. Only float32 on
a CPU, without gradients, MIN_ROWS to MAX_ROWS rows, takes the packed product; anything else is plain
F.linear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

PACK_ROWS = 64  # the rows the packed layout is tuned for; any number of rows is correct (module docstring)
MIN_ROWS = 4  # fewer rows take the plain product (measured: in the whole model it is faster for 1-3 rows)
MAX_ROWS = 256  # more rows too: a prefill's or a capture's products (the LM head over 512 rows: 190 ms
# packed against 170 plain; 64 rows: 18.7 against 24.9)


def packing_available() -> bool:
    """Whether this PyTorch build has MKL's packed product (x86 CPU builds do; others fall back)."""
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


class PackedLinear(torch.nn.Linear):
    """nn.Linear whose float32 CPU inference forward reads a packed copy of the weight (module docstring)."""

    _pack: torch.Tensor | None = None
    _pack_key: tuple | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, n = self.weight, x.numel()
        if not MIN_ROWS * self.in_features <= n <= MAX_ROWS * self.in_features:  # first: one-token steps pay
            return F.linear(x, w, self.bias)  # nothing else
        fits = x.dtype == w.dtype == torch.float32 and x.device.type == w.device.type == "cpu"
        if not fits or (torch.is_grad_enabled() and (w.requires_grad or x.requires_grad)):
            return F.linear(x, w, self.bias)
        return torch.ops.mkl._mkl_linear(x, self.packed_weight(), w, self.bias, n // self.in_features)

    def packed_weight(self) -> torch.Tensor:
        """The packed copy of the current weight, made again when the weight changed since."""
        w = self.weight
        key = (w.data_ptr(), w._version, tuple(w.shape), w.stride())
        if self._pack is None or self._pack_key != key:
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


def pack_linears(module: torch.nn.Module) -> int:
    """Every nn.Linear of `module` becomes a PackedLinear in place; returns how many changed."""
    if not packing_available():
        raise RuntimeError("weight_layout=packed needs a PyTorch build with MKL (x86 CPU builds have it)")
    changed = 0
    for mod in module.modules():
        if type(mod) is torch.nn.Linear:
            mod.__class__ = PackedLinear
            changed += 1
    return changed


def unpack_linears(module: torch.nn.Module) -> int:
    """Every PackedLinear of `module` becomes a plain nn.Linear again (its packed copy dropped)."""
    changed = 0
    for mod in module.modules():
        if type(mod) is PackedLinear:
            mod.__dict__.pop("_pack", None)
            mod.__dict__.pop("_pack_key", None)
            mod.__class__ = torch.nn.Linear
            changed += 1
    return changed
