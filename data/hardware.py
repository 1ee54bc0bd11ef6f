"""What the machine's matrix units can do, for choosing a precision automatically."""

from __future__ import annotations

import functools
from pathlib import Path

# CPU flags (Linux /proc/cpuinfo) of bf16 matrix instructions: Intel AMX tiles, AVX512-BF16 dot products.
BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")


@functools.cache
def cpu_has_bf16_matmul(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """True when the CPU advertises bf16 matrix instructions (False where /proc/cpuinfo is absent)."""
    path = Path(cpuinfo)
    if not path.is_file():
        return False
    for line in path.read_text().splitlines():
        if line.startswith("flags"):
            return any(flag in line.split() for flag in BF16_CPU_FLAGS)
    return False
