"""Whether bf16 matrix products pay on this CPU: measured once per machine, not read from its flags.

The flags (BF16_CPU_FLAGS) say that a CPU HAS native bf16 kernels, not that they are faster than its
float32 ones. On the AMD EPYC of earlier sessions bf16 autocast ran the drafters' training step 1.4-2x
faster; on the Intel Xeon of sessions 11-13 (AVX512-BF16, no AMX) a [1024 x 576] @ [576 x 1536] product
took 21.9 ms in bf16 against 12.0 in float32, and the SpecBlock step ran 1.6x SLOWER under autocast (8.2
against 5.0 s, `scripts/bench_train.py` with and without `--autocast`). So `trainer.mixed_precision=auto`
and `target.dtype=auto` (target.auto_dtype) ask `bf16_matmul_pays`: on a CPU with the flags, PROBE_SHAPE
is multiplied in both precisions (ROUNDS rounds alternating, medians), and bf16 is chosen when it is
faster. The answer is kept per (CPU model, torch version, threads) in `cache_dir()/bf16_matmul.json` under
a file lock, so that every rank of a launch, and every later run on the machine, takes the same decision
without measuring again; delete the file to measure again (a machine whose speed changed under the same CPU
model name keeps the old answer until then).
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import statistics
import time
from pathlib import Path
from typing import Callable

import torch
from filelock import FileLock

from .io import atomic_path
from .packed import PACKED_DTYPES, TRANSPOSED_DTYPES, pack_linears, packable_dtypes, unpack_linears

log = logging.getLogger(__name__)

# CPU flags of native bf16 matrix kernels (oneDNN runs bf16 linear layers on them); without them bf16 is
# emulated through float32 and slower than float32 itself.
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")
PROBE_SHAPE = (1024, 576, 1536)  # rows x hidden x MLP width: a SmolLM2-sized layer's product
ROUNDS = 5
CACHE_ENV = "SPECBLOCK_CACHE"  # where measured machine facts are kept (default ~/.cache/specblock)


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "specblock")


def cpuinfo_field(name: str, path: str = "/proc/cpuinfo") -> str | None:
    """The value of the first `name` line of Linux /proc/cpuinfo; None where the file or line is missing."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return None
    return next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith(name)), None)


def cpu_flags(path: str = "/proc/cpuinfo") -> set[str]:
    """The CPU's feature flags; empty where /proc/cpuinfo does not say."""
    return set((cpuinfo_field("flags", path) or "").split())


def has_bf16_kernels(flags: set[str] | None = None) -> bool:
    """Whether the CPU (or `flags`) has native bf16 matrix kernels (BF16_CPU_FLAGS)."""
    return any(f in (cpu_flags() if flags is None else flags) for f in BF16_CPU_FLAGS)


def cpu_model(path: str = "/proc/cpuinfo") -> str:
    """The CPU's model name, "unknown" where /proc/cpuinfo does not say."""
    return cpuinfo_field("model name", path) or "unknown"


def alternating_ms(runs: dict[str, Callable[[], object]], rounds: int) -> dict[str, list[float]]:
    """The ms of every run of `runs`, `rounds` times each, the runs alternating round by round (a load spike
    hits all of them), after one warm-up each."""
    for run in runs.values():
        run()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append((time.perf_counter() - start) * 1e3)
    return times


def matmul_ms(rounds: int = ROUNDS, shape: tuple[int, int, int] = PROBE_SHAPE) -> dict[str, float]:
    """Median ms of one [m, k] @ [k, n] product in float32 and in bf16 (`alternating_ms`)."""
    m, k, n = shape
    gen = torch.Generator().manual_seed(0)
    pairs = {
        name: (torch.randn(m, k, generator=gen).to(dtype), torch.randn(k, n, generator=gen).to(dtype))
        for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16))
    }
    runs = {name: (lambda a=a, b=b: a @ b) for name, (a, b) in pairs.items()}
    return {name: statistics.median(t) for name, t in alternating_ms(runs, rounds).items()}


def measured(filename: str, measure: Callable[[], dict[str, float]]) -> dict[str, float]:
    """`measure()` for this machine (CPU model, torch version, threads), kept in `cache_dir()/filename`
    under a file lock and read back by every later process; a damaged file is measured again, and where
    nothing can be written (a read-only home) it is measured for this process only, with a warning."""
    key = f"{cpu_model()} | torch {torch.__version__} | {torch.get_num_threads()} threads"
    path = cache_dir() / filename
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(path) + ".lock"):
            try:
                known = json.loads(path.read_text()) if path.exists() else {}
            except json.JSONDecodeError:  # a damaged file: measured again and rewritten
                known = {}
            if key not in known:
                known[key] = measure()
                with atomic_path(path) as tmp:
                    tmp.write_text(json.dumps(known, indent=2, sort_keys=True))
        return known[key]
    except OSError as err:  # nowhere to keep it: measured for this process only
        log.warning(f"WARNING: cannot keep the measurement in {path} ({err}); set {CACHE_ENV}")
        return measure()


@functools.cache
def bf16_matmul_pays() -> bool:
    """Whether bf16 matrix products are faster than float32 ones on this CPU (module docstring): False
    without native bf16 kernels, else measured once per machine and kept."""
    if not has_bf16_kernels():
        return False
    ms = measured("bf16_matmul.json", lambda: matmul_ms())
    return ms["bfloat16"] < ms["float32"]


# Weight layout of a linear layer in decoding. nn.Linear keeps its weight [out, in] row-major, and
# F.linear multiplies by its transpose. For the few rows of a decoding step, the Intel MKL of the torch CPU
# build takes another path when the weight is stored column-major (weight.t() a contiguous [in, out]
# matrix). On the session-14 Xeon (SmolLM2-135M after a 300-token cache, float32, sizes interleaved, medians
# of 22) a forward over 4 / 8 / 16 tokens took 74 / 92 / 108 ms column-major against 83 / 103 / 115
# row-major, and over 1 / 2 tokens 55 / 67 against 54 / 62: wide trees gain, plain decoding does not. The
# same values through another kernel: results differ in the last bits (max |logit difference| 1e-4), so the
# target and every decoder of one comparison share one layout. Session 15: "packed" (data/packed.py, MKL's
# packed product) beats both at 4-32 rows and leaves 1-3 rows to the plain product, so `auto` measures a
# decoding step's products row-major against packed; column-major stays a manual choice. Session 19: bf16
# has a packed product too (oneDNN's, data/packed.py), and a CPU may gain in one precision and lose in the
# other (the AMD EPYC of sessions 17-19: float32 packed 31 % slower, bf16 packed 18 % faster per decoding
# step), so `auto` measures each precision on its own and packs only where it pays: "packed-float32" or
# "packed-bfloat16" pack one precision, "packed" both. Session 38: "transposed" (data/packed.py) multiplies
# float32 as (W x^T)^T, which on the AVX2-only EPYC of sessions 33-38 makes a 4-token forward 1.8x faster
# (1.1x a one-token step); float32 takes one kernel (row-major, packed or transposed), bf16 packs or not, so
# "transposed+packed-bfloat16" is the one combination with both.
WEIGHT_LAYOUTS = (
    "row", "column", "packed", "packed-float32", "packed-bfloat16", "transposed", "transposed+packed-bfloat16"
)  # fmt: skip
# what `auto` weighs; column-major is a manual choice (docs/measured/main_job.md, session 15)
AUTO_LAYOUTS = ("row", "packed", "transposed")
LAYOUT_ROWS = (4, 8)  # rows of a small tree's or chain's products (1-3 rows take the plain product anyway)
BF16_LAYOUT_ROWS = (1, 4, 8)  # bf16 packs one-token steps too (data/packed.py)
# float32's file is new in session 38 (its probe weighs the transposed product too; the old file's did not)
LAYOUT_FILES = {"float32": "linear_layouts_float32.json", "bfloat16": "linear_layouts_bfloat16.json"}
# [in, out] of a SmolLM2-sized layer's seven linears (q, k, v, o, gate, up, down), LAYOUT_LAYERS of them,
# then its LM head: 450 MB of float32 weights, more than a server CPU's last-level cache (260 MB on the
# session-15 Xeon), as a decoding step's are.
LAYOUT_SHAPES = ((576, 576), (576, 192), (576, 192), (576, 576), (576, 1536), (576, 1536), (1536, 576))
LAYOUT_LAYERS = 24
LAYOUT_HEAD = (576, 49152)
LAYOUT_ROUNDS = 5  # ~0.1 s each: the fastest of several, because another job's load only ever adds time


def layout_ms(
    rounds: int = LAYOUT_ROUNDS,
    rows=LAYOUT_ROWS,
    shapes=LAYOUT_SHAPES,
    layers: int = LAYOUT_LAYERS,
    layouts=AUTO_LAYOUTS,
    head: tuple[int, int] | None = LAYOUT_HEAD,
    dtype: torch.dtype = torch.float32,
) -> dict[str, float]:
    """The fastest ms of the small products of a decoding step (every `rows` through `layers` x `shapes`,
    then `head`, in `dtype`) in each of `layouts` this build has (`alternating_ms`; a packed layout only
    where it packs `dtype`, the transposed one in float32, a combination never: in each precision it is one of
    the others). They share the weights where they can (row-major and packed: packed adds its copy;
    column-major has its own)."""
    gen = torch.Generator().manual_seed(0)
    weights = [
        (torch.randn(n_out, n_in, generator=gen) * 0.02).to(dtype)
        for _ in range(layers)
        for n_in, n_out in shapes
    ]
    inputs = {
        w.shape[1]: {m: torch.randn(m, w.shape[1], generator=gen).to(dtype) for m in rows} for w in weights
    }
    packs = next((d for d in packable_dtypes() if PACKED_DTYPES[d] == dtype), None)  # its packed kernel
    stacks = {}
    for name in layouts:
        if name.startswith("packed") and (packs is None or layout_dtypes(name) not in (None, [packs])):
            continue
        if "+" in name or (name == "transposed" and dtype not in TRANSPOSED_DTYPES.values()):
            continue  # in this precision one of the layouts above (a combination is, in each)
        linears = [torch.nn.Linear(w.shape[1], w.shape[0], bias=False) for w in weights]
        for lin, w in zip(linears, weights):
            lin.weight = torch.nn.Parameter(w, requires_grad=False)  # set_weight_layout copies where it must
        stacks[name] = torch.nn.Sequential(*linears)
        set_weight_layout(stacks[name], name)

    def step(linears: torch.nn.Sequential) -> None:
        with torch.no_grad():
            for m in rows:
                for lin in linears:
                    lin(inputs[lin.in_features][m])

    runs = {name: (lambda lins=lins: step(lins)) for name, lins in stacks.items()}
    return {name: min(t) for name, t in alternating_ms(runs, rounds).items()}


@functools.cache
def fastest_layout() -> str:
    """The weight layout whose decoding-step products are fastest on this CPU, measured once per machine and
    kept: float32's kernel the fastest of row-major, packed (where the build has MKL's) and transposed
    (`layout_ms`), bf16 packed where that is faster than row-major (over one-token steps too; where oneDNN
    packs bf16); named by `layout_name`."""
    have = packable_dtypes()
    fp32 = measured(
        LAYOUT_FILES["float32"], functools.partial(layout_ms, rows=LAYOUT_ROWS, dtype=torch.float32)
    )
    kernels = [k for k in AUTO_LAYOUTS if k in fp32 and (k != "packed" or "float32" in have)]
    bf16 = False
    if "bfloat16" in have:
        probe = functools.partial(layout_ms, rows=BF16_LAYOUT_ROWS, dtype=torch.bfloat16)
        ms = measured(LAYOUT_FILES["bfloat16"], probe)
        bf16 = ms.get("packed", math.inf) < ms["row"]
    return layout_name(min(kernels, key=fp32.get), bf16)


def layout_name(fp32: str, bf16_packed: bool) -> str:
    """The layout with float32 on `fp32` (row, packed or transposed) and bf16 packed or row-major."""
    if fp32 == "transposed":
        return "transposed+packed-bfloat16" if bf16_packed else "transposed"
    return packed_layout(["float32"] * (fp32 == "packed") + ["bfloat16"] * bf16_packed)


def packed_layout(dtypes: list[str]) -> str:
    """The layout that packs the linears in `dtypes` (names of data/packed.PACKED_DTYPES) and no others."""
    if not dtypes:
        return "row"
    return "packed" if len(set(dtypes)) > 1 else f"packed-{dtypes[0]}"


def layout_dtypes(layout: str) -> list[str] | None:
    """The precisions a layout packs (None: every one this build has a kernel for); [] for none."""
    if layout == "packed":
        return None
    return [part.removeprefix("packed-") for part in layout.split("+") if part.startswith("packed-")]


def layout_transposes(layout: str) -> list[str]:
    """The precisions a layout multiplies by the transposed product (data/packed.py)."""
    return list(TRANSPOSED_DTYPES) if layout.split("+")[0] == "transposed" else []


def auto_layout(device: str) -> str:
    """`weight_layout=auto`: the `fastest_layout` on a CPU, else "row" (GPU libraries take either layout at
    the same speed and have no packed product; nothing to change)."""
    return fastest_layout() if torch.device(device).type == "cpu" else "row"


def resolve_layout(layout: str, device: str) -> str:
    """A weight_layout setting (WEIGHT_LAYOUTS or auto) as the layout to store: auto per `auto_layout`."""
    return auto_layout(device) if layout == "auto" else layout


def set_weight_layout(module: torch.nn.Module, layout: str) -> int:
    """Stores every nn.Linear weight of `module` row-major ("row": [out, in] contiguous, as loaded),
    column-major ("column": weight.t() contiguous) or row-major with a packed copy its forward reads
    ("packed": in every precision with a packed kernel, "packed-float32" / "packed-bfloat16": in that one;
    data/packed.py), row-major with float32 forwards on the transposed product ("transposed"; with bf16
    packed too: "transposed+packed-bfloat16"), in place: the same values, shapes and parameters (a tied
    embedding shares the new storage). Returns the number of linears that changed."""
    if layout not in WEIGHT_LAYOUTS:
        raise ValueError(f"weight_layout={layout!r}: expected {', '.join(WEIGHT_LAYOUTS)} (or auto)")
    column = layout == "column"
    packed = layout.startswith(("packed", "transposed"))  # on PackedLinear's forward
    changed = 0 if packed else unpack_linears(module)  # packed again: keep the packed copies
    for mod in module.modules():
        if isinstance(mod, torch.nn.Linear) and mod.weight.dim() == 2:
            w = mod.weight.data
            if w.t().is_contiguous() if column else w.is_contiguous():
                continue  # already so (a tied weight met a second time)
            mod.weight.data = w.t().contiguous().t() if column else w.contiguous()
            changed += 1
    if packed:
        changed += pack_linears(module, layout_dtypes(layout), layout_transposes(layout))
    return changed
