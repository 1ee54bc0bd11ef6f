"""Where a decoding iteration's time goes, per method, and what a target forward costs per token fed.

    python scripts/bench_decode.py --methods autoregressive chain-token tree lookup --drafter DIR
    python scripts/bench_decode.py --methods autoregressive lookup --dtype float32 bfloat16
    python scripts/bench_decode.py --drafter untrained-eagle3     # costs only: a random EAGLE-3 drafter

1. Decoding: every method (and every --dtype: target AND drafter in that precision) generates for the
   same prompts, interleaved prompt by prompt, `--repeats` times. Tokens/s is end to end (prefill
   included) as in the evaluation app, the median of the repeats, with its ratio to autoregressive
   decoding in the same precision and to float32 autoregressive decoding. The decoding phase (prefill
   excluded) splits into drafting, target forward, verification and the rest (overhead: bookkeeping,
   cache gathers, sampling) = iteration wall time minus the three, per emitted token and per iteration
   (one target call; for autoregressive decoding one step), summed over all repeats before dividing;
   with the drafter's calls per emitted token and milliseconds per call.
2. The target forward alone against the number of tokens fed (1 ... 128, a causal chain) after a
   `--context`-token KV cache, median of `--forward-repeats`, per dtype (and layout), the models alternating
   forward by forward: a table and a plot.
"""

from __future__ import annotations

import argparse
import copy
import logging
import statistics
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from transformers.cache_utils import DynamicCache

from specblock.data.evalsets import prompt_ids
from specblock.data.hardware import WEIGHT_LAYOUTS, resolve_layout, set_weight_layout
from specblock.data.logs import setup_logging
from specblock.data.target import DEFAULT_TARGET_DIR, DTYPES, FeatureTarget, TargetConfig, load_target

from specblock.evaluate.config import EvalConfig, parse_method, trained_rounds
from specblock.evaluate.decoding.drafters import drafting_spec
from specblock.evaluate.decoding.loop import (
    DRAFTERLESS,
    TREE_MODES,
    DecodeConfig,
    Generation,
    SpeculativeDecoder,
)
from specblock.evaluate.decoding.lookup import LookupConfig
from specblock.evaluate.decoding.target import TargetSession
from specblock.evaluate.decoding.trees import TreeConfig
from specblock.evaluate.reporting.metrics import AUTOREGRESSIVE, ratio
from specblock.evaluate.run import eos_ids, load_set

log = logging.getLogger(__name__)

UNTRAINED = "untrained-"  # --drafter untrained-<name>: a randomly initialised drafter (costs only)
HF_GREEDY = "hf-greedy"  # the leanest baseline: the model's own forward with a cache, nothing else
DATASTORE_MARK = "#ds"  # a label suffix: lookup backed by --datastore (evaluate/decoding/datastore.py)
FORWARD_TOKENS = [1, 2, 4, 8, 16, 32, 64, 128]


@dataclass
class Split:
    """Sums over the decoding phase of many generations (seconds), then divided by tokens or iterations."""

    tokens: int = 0  # tokens emitted after the prefill
    iterations: int = 0  # target calls after the prefill
    draft: float = 0.0
    target: float = 0.0
    verify: float = 0.0
    wall: float = 0.0
    accepted: int = 0
    calls: int = 0  # drafter calls after the prefill
    generations: int = 0
    differ: int = 0  # temperature 0: first-repeat generations whose tokens differ from autoregressive's
    runs: list[tuple[int, float]] = field(default_factory=list)  # per repeat: (tokens, end-to-end seconds)

    def add(self, g: Generation) -> None:
        self.tokens += len(g.tokens) - 1
        self.iterations += len(g.iterations) if g.iterations else len(g.tokens) - 1
        self.draft += sum(it.drafter_seconds for it in g.iterations)
        self.target += g.target_seconds
        self.verify += sum(it.verify_seconds for it in g.iterations)
        self.wall += g.seconds - g.prefill_seconds
        self.accepted += sum(it.accepted for it in g.iterations)
        self.calls += sum(it.drafter_calls for it in g.iterations)
        self.generations += 1

    @property
    def overhead(self) -> float:
        return self.wall - self.draft - self.target - self.verify

    def tokens_per_second(self) -> float:
        """The median over repeats of end-to-end tokens/s (each repeat: all prompts, prefill included)."""
        return statistics.median(n / s for n, s in self.runs)


def make_drafter(
    spec: str | None, model, draft_vocab: int | None = None
) -> tuple[torch.nn.Module | None, dict | None]:
    """(drafter, its folder's config.json) from an exported folder, or `untrained-<name>` (random weights
    with a draft vocabulary of the first `draft_vocab` ids, None = all: the shape of a trained one, costs
    only; no config); (None, None) without a drafter."""
    if spec is None:
        return None, None
    if spec.startswith(UNTRAINED):
        from specblock.train.drafters import build_drafter, train_spec

        name = spec[len(UNTRAINED) :]
        torch.manual_seed(0)
        emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
        d2t = None if draft_vocab is None else torch.arange(draft_vocab)
        cfg = train_spec(name).config(draft_vocab_size=draft_vocab)
        return build_drafter(name, cfg, model.config, emb, head, d2t).eval(), None
    from specblock.train.export import load_drafter

    return load_drafter(spec)


class HFGreedy:
    """Greedy decoding with the bare HF model and a DynamicCache (no 4-D mask, no hidden states, logits
    of the last position only): the check that the loop's autoregressive baseline is not handicapped."""

    def __init__(self, model, max_new_tokens: int, eos: list[int]):
        self.model, self.max_new_tokens, self.eos = model, max_new_tokens, set(eos)

    @torch.no_grad()
    def generate(self, prompt: list[int], seed: int = 0) -> Generation:
        start, dev = time.perf_counter(), self.model.device
        cache = DynamicCache()
        logits = self.model(torch.tensor([prompt], device=dev), cache=cache, logits_to_keep=1).logits
        out = [int(logits[0, -1].argmax())]
        prefill, target = time.perf_counter() - start, 0.0
        while len(out) < self.max_new_tokens and out[-1] not in self.eos:
            t0 = time.perf_counter()
            logits = self.model(torch.tensor([[out[-1]]], device=dev), cache=cache, logits_to_keep=1).logits
            target += time.perf_counter() - t0
            out.append(int(logits[0, -1].argmax()))
        return Generation(out, [], len(out), len(out), time.perf_counter() - start, prefill, target)


def decoders(args, model, eos: list[int], layout: str = "row") -> dict[str, SpeculativeDecoder]:
    """One decoder per method, all on `model`: the methods without a drafter once, the others with the
    drafter in the model's dtype, or once per --drafter-dtype (labelled "<method> d:<dtype>") where several
    are given or one differs; the drafter's linear weights stored in `layout` (the target's)."""
    made, meta = make_drafter(args.drafter, model, args.draft_vocab)
    layers = meta["feature_layers"] if meta else None
    plain = [m for m in args.methods if m == HF_GREEDY or parse_method(method_label(m)[0])[0] in DRAFTERLESS]
    drafted = [m for m in args.methods if m not in plain]
    out = method_decoders(args, model, eos, plain, None, layers)
    kinds = args.drafter_dtype or [None]
    for kind in kinds:
        dtype = model.dtype if kind is None else DTYPES[kind]
        drafter = None if made is None else copy.deepcopy(made).to(device=model.device, dtype=dtype)
        if drafter is not None:
            set_weight_layout(drafter, layout)
        suffix = "" if kind is None or (len(kinds) == 1 and dtype == model.dtype) else f" d:{kind}"
        out.update(
            (m + suffix, dec)
            for m, dec in method_decoders(args, model, eos, drafted, drafter, layers, meta).items()
        )
    return out


def method_decoders(
    args, model, eos: list[int], methods: list[str], drafter, layers, meta: dict | None = None
) -> dict[str, SpeculativeDecoder]:
    """One decoder per method of `methods`, with this drafter (`meta`: its folder's config.json)."""
    out = {}
    for method in methods:
        if method == HF_GREEDY:
            out[method] = HFGreedy(model, args.max_new_tokens, eos)
            continue
        name, size, steps = method_label(method)
        mode, verifier = parse_method(name)
        # the trained-rounds cap (and its log line) only where the label does not set the rounds itself
        tree, length = default_tree(drafter, meta if steps is None else None, args.drafter), args.draft_length
        if steps is not None:
            tree = replace(tree, steps=steps)
        if size and mode in TREE_MODES:
            tree = replace(tree, budget=int(size) if size.isdigit() else size)
        elif size.isdigit():
            length = int(size)
        lookup = LookupConfig()
        if method.endswith(DATASTORE_MARK):
            if not args.datastore:
                raise ValueError(f"method {method!r} drafts from a datastore: give --datastore DATA_FOLDER")
            lookup = LookupConfig(datastore=args.datastore)
        cfg = DecodeConfig(
            mode, verifier, args.num_drafts if mode == "iid" else 1, length, args.temperature,
            max_new_tokens=args.max_new_tokens, tree=tree, auto_length=size == "auto" and mode not in TREE_MODES,
            lookup=lookup,
        )  # fmt: skip
        target = FeatureTarget(model, layers if mode not in ("autoregressive", "lookup") else None)
        out[method] = SpeculativeDecoder(target, drafter, cfg, eos)
    return out


def method_label(method: str) -> tuple[str, str, int | None]:
    """A method label -> (evaluation method, size, tree rounds). tree@16 / tree@auto: the tree's budget;
    chain-token@6 / chain-token@auto: the chain's length (auto: chosen per iteration up to --draft-length);
    a trailing :s<R> (tree@4:s1, tree:s1): the tree's drafter rounds (TreeConfig.steps; default: the
    drafter's own tree, capped at the block rounds it was trained with where its folder records them); a
    trailing #ds (lookup#ds, tree+lookup@auto#ds): lookup backed by the --datastore folder's answers."""
    spec, sep, steps = method.removesuffix(DATASTORE_MARK).partition(":s")
    if sep and not steps.isdigit():
        raise ValueError(f"method {method!r}: ':s' takes a number of tree rounds, e.g. tree@4:s1")
    name, _, size = spec.partition("@")
    return name, size, int(steps) if sep else None


def default_tree(drafter, meta: dict | None = None, folder: str | None = None) -> TreeConfig:
    """The evaluation app's tree shape for this drafter (its spec's, decoding/drafters.py), with its rounds
    capped as the app caps them (`trained_rounds`) where its folder's config.json `meta` records them."""
    if drafter is None:
        return TreeConfig()
    tree = replace(drafting_spec(drafter.cfg.name).default_tree)
    return trained_rounds(drafter.cfg.name, tree, meta, str(folder)) if meta else tree


def auto_budget_lines(decs: dict[str, dict[str, SpeculativeDecoder]]) -> list[str]:
    """For every @auto decoder: the measured forward curve and the budgets (lengths) it chose."""
    lines = []
    for dt, per_dtype in decs.items():
        for m, dec in per_dtype.items():
            auto = getattr(dec, "auto", None)
            if auto is None or auto.curve is None:
                continue
            curve = ", ".join(f"{n}: {ms:.0f}" for n, ms in zip(auto.curve.sizes, auto.curve.ms))
            mean = statistics.mean(auto.chosen) if auto.chosen else float("nan")
            lines.append(
                f"{dt} {m}: forward ms by tokens fed {{{curve}}} (measured in {dec.calibration_seconds:.1f} s); "
                f"budget chosen: mean {mean:.1f}, min {min(auto.chosen)}, max {max(auto.chosen)} over "
                f"{len(auto.chosen)} iterations; calibration c = {auto.c:.2f}, fixed {auto.fixed_ms:.1f} ms"
            )
    return lines


def run_decoding(
    args, models: dict[str, torch.nn.Module], layouts: dict[str, str], eos, prompts
) -> dict[tuple[str, str], Split]:
    """Every (dtype [layout], method) on every prompt, interleaved, `repeats` times after one warm-up
    prompt."""
    return interleave({dt: decoders(args, m, eos, layouts[dt]) for dt, m in models.items()}, args, prompts)


def interleave(decs: dict[str, dict[str, SpeculativeDecoder]], args, prompts) -> dict[tuple[str, str], Split]:
    """Every decoder of `decs` (dtype -> name -> decoder; autoregressive first) on every prompt,
    interleaved, `args.repeats` times after one warm-up prompt of `args.warmup_tokens` tokens."""
    for per_dtype in decs.values():  # warm-up: first-call allocations and kernel selection
        for dec in per_dtype.values():
            dec.generate(prompts[0][: args.warmup_tokens])
    splits = {(dt, m): Split() for dt in decs for m in decs[dt]}
    for r in range(args.repeats):
        totals = {key: [0, 0.0] for key in splits}
        for i, ids in enumerate(prompts):
            for dt, per_dtype in decs.items():
                reference = None  # autoregressive decoding's tokens in this dtype (it runs first)
                for m, dec in per_dtype.items():
                    g = dec.generate(ids, seed=i)
                    reference = g.tokens if m == AUTOREGRESSIVE else reference
                    splits[(dt, m)].add(g)
                    splits[(dt, m)].differ += r == 0 and reference is not None and g.tokens != reference
                    totals[(dt, m)][0] += len(g.tokens)
                    totals[(dt, m)][1] += g.seconds
        for key, (n, s) in totals.items():
            splits[key].runs.append((n, s))
    for line in auto_budget_lines(decs):
        log.info(line)
    return splits


def decoding_table(splits: dict[tuple[str, str], Split], temperature: float) -> str:
    lines = [
        "| dtype | method | tokens / s (median) | x autoregressive (same dtype) | x fastest float32 autoregressive "
        "| tokens / iteration | per token: draft / target / verify / other ms "
        "| per iteration: draft / target / verify / other ms | drafter calls / token | ms / drafter call "
        "| tokens ≠ autoregressive |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    plain32 = [s for (dt, m), s in splits.items() if dt.split()[0] == "float32" and m == AUTOREGRESSIVE]
    f32 = max(plain32, key=Split.tokens_per_second, default=None)  # over the weight layouts measured
    for (dt, m), s in splits.items():
        tps = s.tokens_per_second()
        same = splits.get((dt, AUTOREGRESSIVE))

        def x(ref: Split | None) -> str:
            return "–" if ref is None else f"{tps / ref.tokens_per_second():.2f}x"

        def ms(den: int) -> str:
            return " / ".join(f"{1e3 * ratio(v, den):.2f}" for v in (s.draft, s.target, s.verify, s.overhead))

        per_repeat = s.generations // len(s.runs)
        differ = f"{s.differ} of {per_repeat}" if temperature == 0 else "–"
        calls = (
            f"{ratio(s.calls, s.tokens):.2f} | {1e3 * ratio(s.draft, s.calls):.2f}" if s.calls else "– | –"
        )
        lines.append(
            f"| {dt} | {m} | {tps:.1f} | {x(same)} | {x(f32)} | {ratio(s.tokens, s.iterations):.2f} "
            f"| {ms(s.tokens)} | {ms(s.iterations)} | {calls} | {differ} |"
        )
    return "\n".join(lines) + "\n"


def forward_times(
    models: dict[str, torch.nn.Module], context: int, lengths: list[int], repeats: int
) -> dict[str, dict[int, float]]:
    """Median seconds of one loop-style target forward (TargetSession: 4-D mask, hidden states) over n
    tokens after a `context`-token KV cache, for each model and each n in `lengths`; the cache is cut back
    after each. The models alternate forward by forward (their order reversed every repeat), so that a load
    spike on this shared machine hits all of them."""
    gen = torch.Generator().manual_seed(0)
    vocab = next(iter(models.values())).config.get_text_config().vocab_size
    prompt = torch.randint(0, vocab, (context,), generator=gen).tolist()
    sessions = {}
    for key, model in models.items():
        sessions[key] = TargetSession(FeatureTarget(model))
        sessions[key].reset()
        sessions[key].forward(prompt)
    out: dict[str, dict[int, float]] = {key: {} for key in models}
    for n in lengths:
        ids = torch.randint(0, vocab, (n,), generator=gen).tolist()
        times: dict[str, list[float]] = {key: [] for key in models}
        for r in range(repeats + 1):  # the first is a warm-up for this shape
            for key in list(sessions)[:: 1 if r % 2 else -1]:
                start = time.perf_counter()
                sessions[key].forward(ids)
                times[key].append(time.perf_counter() - start)
                sessions[key].keep(context, [])
        for key in models:
            out[key][n] = statistics.median(times[key][1:])
    return out


def forward_table(times: dict[str, dict[int, float]]) -> str:
    dts = list(times)
    head = " | ".join(f"{dt} ms | {dt} ms / token" for dt in dts)
    lines = [f"| tokens fed | {head} |", "|---" * (1 + 2 * len(dts)) + "|"]
    for n in next(iter(times.values())):
        cells = " | ".join(f"{1e3 * times[dt][n]:.1f} | {1e3 * times[dt][n] / n:.2f}" for dt in dts)
        lines.append(f"| {n} | {cells} |")
    return "\n".join(lines) + "\n"


def plot_forward(times: dict[str, dict[int, float]], context: int, path: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5, 3.5))
    FigureCanvasAgg(fig)  # Agg: no display
    ax = fig.add_subplot()
    for dt, t in times.items():
        ax.plot(list(t), [1e3 * v for v in t.values()], marker="o", label=dt)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens fed in one forward")
    ax.set_ylabel("target forward (ms, median)")
    ax.set_title(f"Target forward vs tokens fed ({context}-token KV cache)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=120)


def load_prompts(args, tokenizer) -> list[list[int]]:
    cfg = EvalConfig(
        drafters={}, methods=[AUTOREGRESSIVE], datasets=[args.dataset], local_root=args.local_root,
        limit=args.prompts,
    )  # fmt: skip
    return [prompt_ids(p, tokenizer)[-args.max_prompt_tokens :] for p in load_set(cfg, args.dataset).prompts]


def parse_args(argv: list[str] | None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--methods", nargs="+", default=["autoregressive", "chain-token", "tree", "lookup"],
        help=f"evaluation methods, and {HF_GREEDY} (temperature 0: the bare HF model with a cache)",
    )  # fmt: skip
    ap.add_argument("--drafter", help="an exported drafter folder, or untrained-eagle3 / untrained-specblock")
    ap.add_argument(
        "--datastore", help="a data folder made for this target: methods labelled #ds draft from its answers"
    )
    ap.add_argument(
        "--draft-vocab",
        type=int,
        default=8192,
        help="an untrained drafter's draft vocabulary (as configs/drafter)",
    )
    ap.add_argument("--target", default=DEFAULT_TARGET_DIR)
    ap.add_argument("--dtype", nargs="+", default=["float32"], choices=sorted(DTYPES))
    ap.add_argument(
        "--drafter-dtype", nargs="+", choices=sorted(DTYPES),
        help="the drafter's precision(s), side by side (default: the target's)",
    )  # fmt: skip
    ap.add_argument(
        "--layout", nargs="+", default=["auto"], choices=["auto", *WEIGHT_LAYOUTS],
        help="the linear weights' storage (target and drafter; data/hardware.py); several: side by side, "
        "each dtype labelled '<dtype> <layout>'",
    )  # fmt: skip
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--threads", type=int, help="torch CPU threads (default torch's; on a CPU other jobs share, 1)"
    )
    ap.add_argument("--dataset", default="humaneval")
    ap.add_argument(
        "--local-root",
        default="auto",
        help="evaluation files (auto: $SPECBLOCK_DATASETS when set, else the hub)",
    )
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--max-prompt-tokens", type=int, default=512)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup-tokens", type=int, default=32, help="prompt tokens of the warm-up generation")
    ap.add_argument("--draft-length", type=int, default=4)
    ap.add_argument("--num-drafts", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--context", type=int, default=300, help="KV cache length before the timed forwards")
    ap.add_argument("--forward-tokens", type=int, nargs="+", default=FORWARD_TOKENS)
    ap.add_argument("--forward-repeats", type=int, default=7)
    ap.add_argument("--plot", default="docs/target_forward_vs_tokens.png")
    ap.add_argument("--skip-decoding", action="store_true")
    ap.add_argument("--skip-forward", action="store_true")
    args = ap.parse_args(argv)
    if args.local_root in ("none", "null"):
        args.local_root = None
    return args


def main(argv: list[str] | None = None) -> None:
    setup_logging()
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    models, layouts, tokenizer = {}, {}, None
    resolved = list(dict.fromkeys(resolve_layout(x, args.device) for x in args.layout))
    for dt in args.dtype:
        for layout in resolved:
            key = dt if len(resolved) == 1 else f"{dt} {layout}"
            models[key], tokenizer = load_target(
                TargetConfig(name_or_path=args.target, dtype=dt, device=args.device)
            )
            set_weight_layout(models[key], layout)
            layouts[key] = layout
    log.info(
        f"target={args.target} device={args.device} torch={torch.__version__} threads={torch.get_num_threads()} "
        f"weight layout={', '.join(resolved)}"
    )
    if not args.skip_decoding:
        prompts = load_prompts(args, tokenizer)
        log.info(
            f"{len(prompts)} {args.dataset} prompts ({sum(map(len, prompts))} tokens), {args.max_new_tokens} new "
            f"tokens, L={args.draft_length}, T={args.temperature}, drafter={args.drafter}, {args.repeats} repeats\n"
        )  # fmt: skip
        splits = run_decoding(args, models, layouts, eos_ids(tokenizer, next(iter(models.values()))), prompts)
        log.info(decoding_table(splits, args.temperature))
    if not args.skip_forward:
        times = forward_times(models, args.context, args.forward_tokens, args.forward_repeats)
        log.info(
            f"target forward after a {args.context}-token cache (median of {args.forward_repeats}, the "
            "precisions / layouts alternating forward by forward):\n"
        )
        log.info(forward_table(times))
        plot_forward(times, args.context, args.plot)
        log.info(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
