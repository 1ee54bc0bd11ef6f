"""The data stage end to end: corpus -> (regenerated) conversations -> token shards (+ offline features).

Each step is skipped when its output exists and its manifest matches this config, so re-running is
cheap and a killed run continues where it stopped (regeneration resumes row by row).

Under `accelerate launch` (a `World` of several ranks, data/world.py) regeneration and feature capture
split their work by rank and merge it on rank 0; tokenization, seconds of work, runs on rank 0 while the
others wait. The outputs are those of a single process.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, replace
import logging
from pathlib import Path

import jinja2
from tqdm.auto import tqdm

from .capture import capture_features
from .config import TOKENS_SUBDIR, PrepareConfig
from .corpora import load_mixture
from .errors import BadInputError, RowPolicy
from .manifest import Manifest, ManifestMismatchError, chat_template_hash, check, code_git_sha
from .manifest import read_manifest, tokenizer_hash
from .regenerate import BACKENDS, RegenerateConfig, fitting_prompts, regenerate, reuse_file
from .shards import write_token_shards
from .target import FeatureTarget, TargetConfig, load_target, load_tokenizer
from .embedded import ensure_embedded_target
from .templates import TemplateMaskError, render_with_mask
from .world import World

log = logging.getLogger(__name__)
# RegenerateConfig fields that do not change the answers (only their rounding, or where they come from)
NOT_IN_RECIPE = ("backend", "weight_layout", "reuse")


@dataclass
class PrepareResult:
    tokens_dir: Path
    num_rows: int
    num_tokens: int
    features_dir: Path | None = None


def expected_manifest(cfg: PrepareConfig, tokenizer) -> Manifest:
    """What the token shards of this config must record (checked against an existing folder). The
    regeneration backend and weight layout are left out of the recipe: they change only the rounding, and shards made
    before it existed stay valid (so is a hub subset that is not set); so are the files regeneration reuses
    rows from (`regenerate.reuse`): a reused row is the answer these settings give its prompt."""
    regenerate = {k: v for k, v in asdict(cfg.regenerate).items() if k not in NOT_IN_RECIPE}
    corpus = asdict(cfg.corpus)
    if corpus["subset"] is None:  # a field added later: shards made before it stay valid
        del corpus["subset"]
    recipe = {"corpus": corpus, "regenerate": regenerate}
    if cfg.mix:  # added later too: only a mixture records it
        recipe["mix"] = [asdict(m) for m in cfg.mix]
    return Manifest(
        kind="tokens",
        target_id=cfg.target.target_id,
        target_revision=cfg.target.revision,
        tokenizer_hash=tokenizer_hash(tokenizer),
        chat_template_hash=chat_template_hash(tokenizer),
        max_length=cfg.max_length,
        dtype="int32",
        code_git_sha=code_git_sha(),
        extra=recipe,
    )


def up_to_date(tokens_dir: Path, expected: Manifest, overwrite: bool) -> bool:
    """True when tokens_dir holds shards made by this very recipe; raises on a mismatch unless overwrite."""
    if not (tokens_dir / "manifest.json").is_file():
        return False
    found = read_manifest(tokens_dir)
    try:
        check(found, expected, where=str(tokens_dir / "manifest.json"))
        check(found, {"extra": expected.extra}, where=str(tokens_dir / "manifest.json"))
    except ManifestMismatchError:
        if overwrite:
            return False
        raise
    return True


def tokenize(conversations, tokenizer, max_length: int, policy: RowPolicy) -> list[dict]:
    """Template + assistant mask per conversation. A row the chat template cannot render (e.g. a template
    that insists on alternating roles) is a bad row for `policy`, not the end of the run."""
    rows = []
    for n, (cid, turns) in enumerate(tqdm(conversations, desc="tokenize", unit="conv")):
        try:
            ids, mask = render_with_mask(tokenizer, turns, max_length)
        except (TemplateMaskError, jinja2.TemplateError) as err:
            policy.bad(BadInputError(f"conversation {cid}", n, "turns", f"chat template: {err}"))
            continue
        if sum(mask) == 0:  # the cut removed every assistant token: nothing to learn from this row
            policy.skipped["no assistant token within max_length"] += 1
            continue
        rows.append({"id": cid, "input_ids": ids, "loss_mask": mask})
    return rows


def prepare(cfg: PrepareConfig, world: World = World()) -> PrepareResult:
    """Runs the stage; the target model itself is loaded only for regeneration or feature capture. Every
    rank of `world` calls it; each returns the same result once the outputs are complete."""
    out = Path(cfg.out_dir)
    if world.is_main:  # made once, not by every rank at the same time
        ensure_embedded_target(cfg.target.name_or_path)
    world.barrier()
    target_cfg = replace(cfg.target, device=world.device(cfg.target.device))
    tokenizer = load_tokenizer(target_cfg)
    model = functools.cache(lambda: load_target(target_cfg)[0])
    tokens_dir, expected = out / TOKENS_SUBDIR, expected_manifest(cfg, tokenizer)
    if up_to_date(tokens_dir, expected, cfg.overwrite):
        manifest = read_manifest(tokens_dir)
        if world.is_main:
            log.info(f"token shards up to date: {tokens_dir} ({manifest.num_samples} rows)")
    else:
        manifest = make_token_shards(cfg, target_cfg, tokenizer, model, expected, world)
    result = PrepareResult(tokens_dir, manifest.num_samples, manifest.num_tokens)
    if cfg.features.enabled:
        from .shards import TokenDataset

        target = FeatureTarget(
            model(), target_cfg.feature_layers, target_id=target_cfg.target_id, revision=target_cfg.revision
        )
        rows = [{k: v.tolist() for k, v in row.items()} for row in TokenDataset(tokens_dir)]
        result.features_dir = capture_features(
            target,
            rows,
            out / cfg.features.subdir,
            cfg.features,
            tokenizer=tokenizer,
            source=str(tokens_dir),
            tokens_manifest=manifest,
            world=world,
        )
    if world.is_main:
        log.info(
            f"token shards: {tokens_dir} ({result.num_rows} rows, {result.num_tokens} tokens); "
            f"manifest: {tokens_dir / 'manifest.json'}"
        )
        if result.features_dir:
            log.info(
                f"target features: {result.features_dir}; manifest: {result.features_dir / 'manifest.json'}"
            )
    return result


def make_token_shards(
    cfg: PrepareConfig, target_cfg: TargetConfig, tokenizer, model, expected: Manifest, world: World
) -> Manifest:
    """corpus -> (regenerated, split over the ranks) conversations -> token shards, written by rank 0;
    returns their manifest on every rank. target_cfg: cfg.target on this rank's device; `model()` loads
    the HF target (once)."""
    out, policy = Path(cfg.out_dir), RowPolicy(cfg.corpus.on_bad_row)
    if cfg.regenerate.enabled:
        BACKENDS[cfg.regenerate.backend].check()  # before any work: a missing engine is named at once
        check_reuse(cfg.regenerate, expected)
    conversations = load_mixture(cfg.corpus, cfg.mix, policy)
    drawn = len(conversations)
    if cfg.regenerate.enabled:
        conversations = fitting_prompts(tokenizer, conversations, cfg.regenerate, policy)
        backend = BACKENDS[cfg.regenerate.backend]
        generator = backend.load(target_cfg, cfg.regenerate, world, model)
        conversations = regenerate(
            generator, tokenizer, conversations, out / "regenerated.jsonl", cfg.regenerate, world
        )
    if world.is_main:
        rows = tokenize(conversations, tokenizer, cfg.max_length, policy)
        log.info(
            f"corpus: {drawn} conversations drawn (limit {cfg.corpus.limit}"
            f"{f', {len(cfg.mix)} corpora mixed in' if cfg.mix else ''}), {len(rows)} rows kept; "
            f"bad rows in the source and after filtering: {policy.summary()}"
        )
        write_token_shards(rows, out / TOKENS_SUBDIR, expected, cfg.shard_rows)
    world.barrier()  # the token shards exist for every rank
    return read_manifest(out / TOKENS_SUBDIR)


# The regeneration settings a reused answer must share with this run's (`check_reuse`); the seed only when
# sampling. The others change which prompts are kept, how they are batched or how the products round.
ANSWER_SETTINGS = ("turns", "max_new_tokens", "temperature", "top_p", "seed")


def check_reuse(cfg: RegenerateConfig, expected: Manifest) -> None:
    """Refuses a `regenerate.reuse` entry whose data folder's token manifest records another target, chat
    template or regeneration settings (ANSWER_SETTINGS), naming every differing field. An entry with no
    manifest beside it (a bare regenerated.jsonl, or a folder not yet tokenized) is taken on trust, with a
    warning saying so."""
    for entry in cfg.reuse:
        path = reuse_file(entry)
        where = path.parent / TOKENS_SUBDIR / "manifest.json"
        if not where.is_file():
            log.warning(
                f"regenerate.reuse: no token manifest at {where}, so {path}'s target and settings cannot be "
                "checked: its answers are taken as this target's with these settings"
            )
            continue
        found = read_manifest(where)
        identity = ("target_id", "target_revision", "chat_template_hash")
        check(found, {name: getattr(expected, name) for name in identity}, where=str(where))
        ours, theirs = expected.extra["regenerate"], found.extra.get("regenerate", {})
        names = [n for n in ANSWER_SETTINGS if n != "seed" or ours.get("temperature", 0) > 0]
        diffs = [
            f"  regenerate.{n}: expected {ours.get(n)!r} vs found {theirs.get(n)!r}"
            for n in names
            if ours.get(n) != theirs.get(n)
        ]
        if diffs:
            raise ManifestMismatchError(
                f"{where}: regenerate.reuse={entry} holds answers made with other settings:\n"
                + "\n".join(diffs)
            )
