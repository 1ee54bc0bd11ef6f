"""`target.dtype=auto` on a CPU: the precision the evaluation decodes fastest in, measured on this machine.

CPU flags cannot tell. Two 2-core machines with AVX512-BF16 and no AMX (README "Precision"):
- an AMD EPYC, where a bf16 forward over 8 / 32 tokens after a 300-token cache costs 50 / 60 ms against
  79 / 100 in float32 (one token: 45 against 42), so bf16 trees verify almost for free and pay;
- an Intel Xeon, where a one-token bf16 step is slower than a float32 one (78 against 66 ms; plain decoding
  15.0 against 17.6 tokens/s) and the quick drafters' trees ran faster over a float32 target (0.97x against
  0.87x of float32 plain decoding, `scripts/bench_decode.py --dtype bfloat16 float32`).
`auto_dtype` first rules bf16 out where bf16 matrix products are not faster than float32 ones
(data/hardware.py: on that Xeon a bf16 product takes 1.3-1.8x the float32 time). Where they are faster, which
precision DECODES faster still depends on both forward curves (a one-token step is not a matrix product) AND
on how much the drafter gets accepted (a better drafter earns wider trees, where bf16 is cheaper). So where
`auto` resolved to bf16 on a CPU, the evaluation decodes a probe in both precisions with its own first
drafting method and drafter (`probe_method`) and keeps the faster: the first prompt, up to PROBE_TOKENS new
tokens, PROBE_ROUNDS rounds alternating the precisions, the median seconds per token of each (the report's
tokens/s, prefill included). On a GPU auto stays bf16, and an explicit target.dtype is never probed.
"""

from __future__ import annotations

import copy
import logging
import statistics
from dataclasses import replace
from typing import Any, Callable, NamedTuple

from specblock.data.evalsets import EvalPrompt, turn_ids
from specblock.data.target import DTYPES, TargetConfig

from .config import EvalConfig, parse_method
from .decoding.loop import DRAFTERLESS, SpeculativeDecoder

log = logging.getLogger(__name__)

CANDIDATES = ("bfloat16", "float32")
PROBE_TOKENS = 64  # at most; the evaluation's max_new_tokens when smaller
PROBE_ROUNDS = 3
PREFERRED = ("tree", "tree+lookup")  # the methods a speed table is about, probed first when listed


class PrecisionProbe(NamedTuple):
    """The chosen precision, the method and drafter probed, and each precision's median ms per token."""

    dtype: str
    method: str
    drafter: str | None
    ms_per_token: dict[str, float]

    def note(self) -> str:
        """One Markdown paragraph for the report."""
        what = f"{self.drafter}:{self.method}" if self.drafter else self.method
        times = ", ".join(f"{d} {ms:.1f}" for d, ms in self.ms_per_token.items())
        return (
            f"\nPrecision (target.dtype=auto): {self.dtype}, measured here. {what} decoded the first prompt "
            f"in each precision ({PROBE_ROUNDS} rounds, median ms per token: {times}); the faster one "
            "decodes the whole evaluation.\n"
        )


def probe_method(methods: list[str], drafters: list[str]) -> tuple[str, str | None]:
    """(method, drafter) the probe decodes with: a tree method when listed, else the first drafting method,
    else lookup, else autoregressive; the first drafter for a method that drafts with one."""
    drafting = [m for m in methods if parse_method(m)[0] not in DRAFTERLESS] if drafters else []
    for m in [*(m for m in PREFERRED if m in drafting), *drafting]:
        return m, drafters[0]
    return ("lookup" if "lookup" in methods else "autoregressive"), None


def choose_precision(
    seconds_per_token: Callable[[str], float],
    candidates: tuple[str, ...] = CANDIDATES,
    rounds: int = PROBE_ROUNDS,
) -> tuple[str, dict[str, float]]:
    """The candidate with the lowest median of `seconds_per_token(dtype)` over `rounds` rounds (each round
    runs every candidate once, in turn, so that a load spike hits all of them), and each one's median ms."""
    times: dict[str, list[float]] = {d: [] for d in candidates}
    for _ in range(rounds):
        for d in candidates:
            times[d].append(seconds_per_token(d) * 1e3)
    ms = {d: statistics.median(t) for d, t in times.items()}
    return min(candidates, key=lambda d: ms[d]), ms


def precision_note(target: TargetConfig, probe: PrecisionProbe | None) -> str:
    """The report's line on how target.dtype=auto was decided ("" for an explicit dtype)."""
    if probe is not None:
        return probe.note()
    if not target.dtype_auto:
        return ""
    bf16 = target.dtype == "bfloat16"
    if target.device.startswith("cuda"):
        why = "this GPU supports bf16" if bf16 else "this GPU does not support bf16"
    elif bf16:
        why = (
            "bf16 matrix products are faster on this CPU (data/hardware.py); no prompt to probe decoding with"
        )
    else:
        why = "bf16 matrix products are not faster than float32 ones on this CPU (data/hardware.py)"
    return f"\nPrecision (target.dtype=auto): {target.dtype}: {why}.\n"


def needs_probe(cfg: EvalConfig) -> bool:
    """Whether the evaluation measures its precision: target.dtype was auto and resolved to bf16 on a CPU
    (where float32 is a candidate too; auto resolves to float32 only where bf16 products are slower)."""
    t = cfg.target
    return t.dtype_auto and t.dtype == "bfloat16" and not t.device.startswith("cuda")


def measure_precision(
    cfg: EvalConfig,
    model,
    tokenizer,
    prompt: EvalPrompt,
    make: Callable[[EvalConfig, Any, list[int]], list[tuple[str, SpeculativeDecoder]]],
    eos: list[int],
) -> tuple[Any, PrecisionProbe, dict[str, Any]]:
    """Decodes `prompt` with the probed method in every candidate precision (module docstring) and returns the
    target in the faster one (`model` itself or a copy), the probe, and the target in every candidate
    precision by name (the plain-decoding baselines reuse them instead of copying the target again); sets
    cfg.target.dtype to the faster one. `make(cfg, model, eos)` builds the (label, decoder) runs of a config
    (run.decoders)."""
    method, drafter = probe_method(cfg.methods, list(cfg.drafters))
    models = {cfg.target.dtype: model}
    for d in CANDIDATES:
        if d not in models:  # (setdefault would copy the model for the loaded precision too)
            models[d] = copy.deepcopy(model).to(DTYPES[d])
    ids = turn_ids(prompt, [], tokenizer)[-cfg.max_prompt_tokens :]
    decoders = {}
    for d, m in models.items():
        probe_cfg = replace(
            cfg,
            target=replace(cfg.target, dtype=d),
            methods=[method],
            drafters={drafter: cfg.drafters[drafter]} if drafter else {},
            baseline_dtypes=[],
            max_new_tokens=min(cfg.max_new_tokens, PROBE_TOKENS),
            adapt=replace(cfg.adapt, enabled=False),
        )
        decoders[d] = make(probe_cfg, m, eos)[0][1]

    def seconds_per_token(d: str) -> float:
        g = decoders[d].generate(ids, seed=cfg.seed)
        return g.seconds / max(len(g.tokens), 1)

    dtype, ms = choose_precision(seconds_per_token, tuple(models))
    cfg.target.dtype = dtype
    probe = PrecisionProbe(dtype, method, drafter, ms)
    log.info(probe.note().strip())
    return models[dtype], probe, models
