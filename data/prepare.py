"""The data stage end to end: corpus -> (regenerated) conversations -> token shards (+ offline features).

Each step is skipped when its output exists and its manifest matches this config, so re-running is
cheap and a killed run continues where it stopped (regeneration resumes row by row).
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass
from pathlib import Path

import jinja2
from tqdm.auto import tqdm

from .capture import capture_features
from .config import PrepareConfig
from .corpora import load_conversations
from .errors import BadInputError, RowPolicy
from .manifest import Manifest, ManifestMismatchError, chat_template_hash, check, code_git_sha
from .manifest import read_manifest, tokenizer_hash
from .regenerate import fitting_prompts, regenerate
from .shards import write_token_shards
from .target import FeatureTarget, ensure_embedded_target, load_target, load_tokenizer
from .templates import TemplateMaskError, render_with_mask


@dataclass
class PrepareResult:
    tokens_dir: Path
    num_rows: int
    num_tokens: int
    features_dir: Path | None = None


def expected_manifest(cfg: PrepareConfig, tokenizer) -> Manifest:
    """What the token shards of this config must record (checked against an existing folder)."""
    recipe = {"corpus": asdict(cfg.corpus), "regenerate": asdict(cfg.regenerate)}
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


def prepare(cfg: PrepareConfig) -> PrepareResult:
    """Runs the stage; the target model itself is loaded only for regeneration or feature capture."""
    out = Path(cfg.out_dir)
    ensure_embedded_target(cfg.target.name_or_path)
    tokenizer = load_tokenizer(cfg.target)
    model = functools.cache(lambda: load_target(cfg.target)[0])
    tokens_dir, expected = out / "tokens", expected_manifest(cfg, tokenizer)
    if up_to_date(tokens_dir, expected, cfg.overwrite):
        manifest = read_manifest(tokens_dir)
        print(f"token shards up to date: {tokens_dir} ({manifest.num_samples} rows)")
    else:
        policy = RowPolicy(cfg.corpus.on_bad_row)
        conversations = load_conversations(cfg.corpus, policy)
        drawn = len(conversations)
        if cfg.regenerate.enabled:
            conversations = fitting_prompts(tokenizer, conversations, cfg.regenerate, policy)
            conversations = regenerate(
                model(), tokenizer, conversations, out / "regenerated.jsonl", cfg.regenerate
            )
        rows = tokenize(conversations, tokenizer, cfg.max_length, policy)
        print(
            f"corpus: {drawn} conversations drawn (limit {cfg.corpus.limit}), {len(rows)} rows kept; "
            f"bad rows in the source and after filtering: {policy.summary()}"
        )
        manifest = write_token_shards(rows, tokens_dir, expected, cfg.shard_rows)
    result = PrepareResult(tokens_dir, manifest.num_samples, manifest.num_tokens)
    if cfg.features.enabled:
        from .shards import TokenDataset

        target = FeatureTarget(
            model(), cfg.target.feature_layers, target_id=cfg.target.target_id, revision=cfg.target.revision
        )
        rows = [{k: v.tolist() for k, v in row.items()} for row in TokenDataset(tokens_dir)]
        result.features_dir = capture_features(
            target,
            rows,
            out / "features",
            cfg.features,
            tokenizer=tokenizer,
            source=str(tokens_dir),
            tokens_manifest=manifest,
        )
    print(
        f"token shards: {tokens_dir} ({result.num_rows} rows, {result.num_tokens} tokens); "
        f"manifest: {tokens_dir / 'manifest.json'}"
    )
    if result.features_dir:
        print(f"target features: {result.features_dir}; manifest: {result.features_dir / 'manifest.json'}")
    return result
