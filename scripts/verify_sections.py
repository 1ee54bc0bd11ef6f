"""Where sampled verification's time goes in the decoding loop, per emitted token, part by part.

    python scripts/verify_sections.py --methods iid-spectr iid-spectr_gbv --drafter DIR --temperature 0.7

Takes bench_decode.py's arguments. Each part is timed in place by wrapping the loop's functions (one
thread, prompts in order, `--repeats` passes, one line per method and pass):
- softmax: the target's tempered law at every node of the tree (`next_token_law`);
- columns: those laws over the draft vocabulary's columns (`DraftColumns.target`);
- continuation: a cross-iteration verifier's rows for the next verification (`RGBVContinuation.prepare`),
  inside `book.prefetch`, which also makes the drafter calls for their draft laws (counted as drafting by
  the loop, not as verification);
- input: the verification input [K, L+1, columns] (`LawBook.laws`);
- total: the whole of `_verify`; what the parts leave is mostly the verifier call.
"""

from __future__ import annotations

import collections
import logging
import time

import torch

from bench_decode import decoders, load_prompts, parse_args
from specblock.data.logs import setup_logging
from specblock.data.target import TargetConfig, load_target
from specblock.evaluate.decoding import columns, continuations, loop
from specblock.evaluate.run import eos_ids
from specblock.evaluate.verify import continuation

log = logging.getLogger(__name__)

PARTS = [  # (owner, attribute, label)
    (loop.SpeculativeDecoder, "_verify", "total"),
    (loop, "next_token_law", "softmax"),
    (columns.DraftColumns, "target", "columns"),
    (continuations.LawBook, "prefetch", "prefetch (continuation + drafter)"),
    (continuation.RGBVContinuation, "prepare", "continuation"),
    (continuations.LawBook, "laws", "input"),
]


def wrap(seconds: collections.Counter) -> None:
    """Time every part in PARTS into `seconds` (label -> seconds)."""
    for owner, name, label in PARTS:
        fn = getattr(owner, name)

        def timed(*args, _fn=fn, _label=label, **kwargs):
            start = time.perf_counter()
            try:
                return _fn(*args, **kwargs)
            finally:
                seconds[_label] += time.perf_counter() - start

        setattr(owner, name, timed)


def main() -> None:
    setup_logging()
    args = parse_args(None)
    torch.set_num_threads(args.threads or 1)
    seconds: collections.Counter = collections.Counter()
    wrap(seconds)
    model, tokenizer = load_target(TargetConfig(name_or_path=args.target, dtype=args.dtype[0]))
    prompts, eos = load_prompts(args, tokenizer), eos_ids(tokenizer, model)
    decs = decoders(args, model, eos)
    for dec in decs.values():  # warm-up
        dec.generate(prompts[0][: args.warmup_tokens])
    lines = ["| method | pass | tokens | " + " | ".join(label for *_, label in PARTS) + " |"]
    lines.append("|---" * (3 + len(PARTS)) + "|")
    for r in range(args.repeats):
        for method, dec in decs.items():
            seconds.clear()
            tokens = sum(len(dec.generate(ids, seed=i).tokens) - 1 for i, ids in enumerate(prompts))
            cells = " | ".join(f"{1e3 * seconds[label] / tokens:.2f}" for *_, label in PARTS)
            lines.append(f"| {method} | {r + 1} | {tokens} | {cells} |")
    log.info("ms per emitted token:\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
