"""manifest.json: the provenance of a folder of shards (tokens or target features).

Readers refuse a mismatch: `check(manifest, expected)` names every field that differs, and
`verify_shards` re-hashes the shard files on demand. Writing is atomic (temp name, then rename), so a
folder with a manifest.json is a complete folder.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import subprocess
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Mapping

from .errors import BadInputError
from .io import sha256_file, write_json_atomic

MANIFEST_NAME = "manifest.json"
# Bumped when a field changes meaning; readers refuse versions they do not know.
MANIFEST_VERSION = 1
KINDS = ("tokens", "features")
# What makes two shard folders interchangeable: a reader that expects a Manifest compares these.
# Counts, checksums, code sha and time describe one particular run and are not compared.
IDENTITY_FIELDS = (
    "kind",
    "target_id",
    "target_revision",
    "tokenizer_hash",
    "chat_template_hash",
    "layer_ids",
    "dtype",
    "max_length",
)
# `git rev-parse` is local and instant; the bound only guards against a hung filesystem.
GIT_TIMEOUT_S = 5


@dataclass
class ShardInfo:
    """One shard file, named relative to the manifest's folder."""

    file: str
    rows: int
    sha256: str


@dataclass
class Manifest:
    """Provenance of a shard folder. layer_ids are target hidden_states indices (empty for kind='tokens');
    dtype is the stored dtype of the main tensors ('int32' for token ids, 'bfloat16'/'float16' for
    features)."""

    kind: str
    target_id: str
    tokenizer_hash: str
    max_length: int
    dtype: str
    target_revision: str | None = None
    chat_template_hash: str | None = None
    layer_ids: list[int] = field(default_factory=list)
    hidden_size: int | None = None
    cut_repeats: int = 0  # features: answers cut where they first repeat an n-token span (0: whole rows)
    num_samples: int = 0
    num_tokens: int = 0
    shards: list[ShardInfo] = field(default_factory=list)
    code_git_sha: str | None = None
    created: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    version: int = MANIFEST_VERSION

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"manifest kind must be one of {KINDS}, got {self.kind!r}")
        if self.kind == "features" and not self.layer_ids:
            raise ValueError("a features manifest needs layer_ids (the target hidden_states it holds)")
        if sum(s.rows for s in self.shards) != self.num_samples:
            raise ValueError(
                f"shards hold {sum(s.rows for s in self.shards)} rows but num_samples={self.num_samples}"
            )
        if not self.created:
            self.created = datetime.now(timezone.utc).isoformat(timespec="seconds")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# field -> accepted JSON types; the reader names the field and the type it found.
_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "version": (int,),
    "kind": (str,),
    "target_id": (str,),
    "target_revision": (str, type(None)),
    "tokenizer_hash": (str,),
    "chat_template_hash": (str, type(None)),
    "layer_ids": (list,),
    "dtype": (str,),
    "max_length": (int,),
    "hidden_size": (int, type(None)),
    "cut_repeats": (int,),  # absent from older manifests: read as 0
    "num_samples": (int,),
    "num_tokens": (int,),
    "shards": (list,),
    "code_git_sha": (str, type(None)),
    "created": (str,),
    "extra": (dict,),
}
_REQUIRED = tuple(
    f.name
    for f in dataclasses.fields(Manifest)
    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
)
_SHARD_TYPES = {"file": (str,), "rows": (int,), "sha256": (str,)}


def write_manifest(folder: str | Path, manifest: Manifest) -> Path:
    """Writes `folder/manifest.json` atomically and returns its path."""
    path = Path(folder) / MANIFEST_NAME
    write_json_atomic(path, manifest.to_dict())
    return path


def read_manifest(path: str | Path) -> Manifest:
    """Reads a manifest.json (or the one inside a folder: any path not ending in .json). Raises BadInputError
    naming the file and the field when it is missing, malformed, of an unknown version, or inconsistent."""
    path = Path(path)
    path = (
        path if path.suffix == ".json" and not path.is_dir() else path / MANIFEST_NAME
    )  # one name in every error
    if not path.is_file():
        raise BadInputError(
            str(path), None, None, "no manifest here (was the capture or prepare step finished?)"
        )
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise BadInputError(str(path), None, None, f"not valid JSON ({err})") from err
    if not isinstance(raw, dict):
        raise BadInputError(str(path), None, None, f"expected a JSON object, found {type(raw).__name__}")
    _check_fields(path, raw)
    shards = [_shard(path, i, s) for i, s in enumerate(raw.get("shards", []))]
    try:
        return Manifest(**{**raw, "shards": shards})
    except ValueError as err:
        raise BadInputError(str(path), None, None, str(err)) from err


def _check_fields(path: Path, raw: dict[str, Any]) -> None:
    for name in raw:
        if name not in _FIELD_TYPES:
            raise BadInputError(str(path), None, name, "unknown field (written by a newer version?)")
    for name in _REQUIRED:
        if name not in raw:
            raise BadInputError(str(path), None, name, "missing required field")
    for name, value in raw.items():
        if not isinstance(value, _FIELD_TYPES[name]) or isinstance(value, bool) and int in _FIELD_TYPES[name]:
            want = " or ".join("null" if t is type(None) else t.__name__ for t in _FIELD_TYPES[name])
            raise BadInputError(
                str(path), None, name, f"expected {want}, found {type(value).__name__} {value!r}"
            )
    if raw.get("version", MANIFEST_VERSION) != MANIFEST_VERSION:
        raise BadInputError(
            str(path),
            None,
            "version",
            f"unknown version {raw['version']} (this code reads version {MANIFEST_VERSION})",
        )
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in raw.get("layer_ids", [])):
        raise BadInputError(
            str(path), None, "layer_ids", f"expected a list of ints, found {raw['layer_ids']!r}"
        )


def _shard(path: Path, index: int, raw: Any) -> ShardInfo:
    where = f"shards[{index}]"
    if not isinstance(raw, dict) or set(raw) != set(_SHARD_TYPES):
        raise BadInputError(
            str(path), None, where, f"expected an object with keys {sorted(_SHARD_TYPES)}, found {raw!r}"
        )
    for name, types in _SHARD_TYPES.items():
        if not isinstance(raw[name], types) or isinstance(raw[name], bool):
            raise BadInputError(
                str(path), None, f"{where}.{name}", f"expected {types[0].__name__}, found {raw[name]!r}"
            )
    return ShardInfo(**raw)


class ManifestMismatchError(ValueError):
    """A shard folder made with different settings than the reader expects; lists every field that differs."""


def check(manifest: Manifest, expected: Manifest | Mapping[str, Any], *, where: str = MANIFEST_NAME) -> None:
    """Refuses a mismatch. `expected` is a Manifest (its IDENTITY_FIELDS are compared) or a mapping of
    field -> expected value (only those fields are compared). The error lists
    `field: expected X vs found Y`."""
    wanted = (
        {name: getattr(expected, name) for name in IDENTITY_FIELDS}
        if isinstance(expected, Manifest)
        else dict(expected)
    )
    unknown = [name for name in wanted if name not in _FIELD_TYPES]
    if unknown:
        raise ValueError(f"check(): {unknown} are not manifest fields")
    diffs = [
        f"  {name}: expected {value!r} vs found {getattr(manifest, name)!r}"
        for name, value in wanted.items()
        if _normalise(getattr(manifest, name)) != _normalise(value)
    ]
    if diffs:
        raise ManifestMismatchError(f"{where} does not match what this run expects:\n" + "\n".join(diffs))


def _normalise(value: Any) -> Any:
    """Tuples from configs compare equal to the lists JSON gives back."""
    return list(value) if isinstance(value, tuple) else value


def verify_shards(manifest: Manifest, folder: str | Path) -> None:
    """Re-hashes every shard listed in the manifest; raises BadInputError naming the first file that is
    missing or whose sha256 differs."""
    for shard in manifest.shards:
        path = Path(folder) / shard.file
        if not path.is_file():
            raise BadInputError(str(path), None, None, f"shard listed in {MANIFEST_NAME} is missing")
        found = sha256_file(path)
        if found != shard.sha256:
            raise BadInputError(
                str(path),
                None,
                "sha256",
                f"checksum mismatch: {MANIFEST_NAME} says {shard.sha256}, the file has {found}",
            )


def tokenizer_hash(tokenizer: Any) -> str:
    """sha256 of what decides the token ids: model type, vocab, merges (BPE) or piece scores (Unigram), added
    tokens, special tokens. Built from values rather than the serialised tokenizer file, whose layout changes
    between library versions (merges went from "a b" strings to [a, b] pairs), so the hash survives an
    upgrade; equal for the same tokenizer loaded from a GGUF or from a saved folder."""
    model = json.loads(tokenizer.backend_tokenizer.to_str())["model"] if tokenizer.is_fast else {}
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    added = sorted((i, t.content, t.special) for i, t in tokenizer.added_tokens_decoder.items())
    return _sha256_json(
        {
            "model": model.get("type", type(tokenizer).__name__),
            "vocab": sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1]),
            "merges": merges,
            "scores": model.get("vocab") if model.get("type") == "Unigram" else None,
            "added_tokens": added,
            "special_tokens": tokenizer.special_tokens_map,
        }
    )


def chat_template_hash(tokenizer: Any) -> str | None:
    """sha256 of the tokenizer's chat template (a string or a dict of named templates); None if none."""
    template = getattr(tokenizer, "chat_template", None)
    return None if not template else _sha256_json(template)


def _sha256_json(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


def code_git_sha(repo_dir: str | Path | None = None) -> str | None:
    """The commit of the code that made an artifact, or None when it is not a git checkout (an installed
    wheel), git is missing, or anything else goes wrong: provenance must never fail a run."""
    cwd = Path(repo_dir) if repo_dir is not None else Path(__file__).resolve().parent
    try:
        done = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=GIT_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    sha = done.stdout.strip()
    return sha if done.returncode == 0 and sha else None
