import json
import re
import subprocess

import pytest

from specblock.data import manifest as mf
from specblock.data.errors import BadInputError
from specblock.data.manifest import (
    Manifest,
    ManifestMismatchError,
    ShardInfo,
    chat_template_hash,
    check,
    code_git_sha,
    read_manifest,
    tokenizer_hash,
    verify_shards,
    write_manifest,
)
from specblock.data.io import sha256_file


def _manifest(tmp_path, **overrides) -> Manifest:
    shard = tmp_path / "features-00000.safetensors"
    shard.write_bytes(b"shard bytes")
    fields = dict(
        kind="features",
        target_id="checkpoints/targets/tiny",
        tokenizer_hash="ab" * 32,
        chat_template_hash="cd" * 32,
        layer_ids=[2, 3, 4],
        dtype="bfloat16",
        max_length=64,
        hidden_size=32,
        num_samples=3,
        num_tokens=40,
        shards=[ShardInfo(file=shard.name, rows=3, sha256=sha256_file(shard))],
    )
    return Manifest(**{**fields, **overrides})


def test_write_then_read_gives_the_same_manifest(tmp_path):
    m = _manifest(tmp_path, code_git_sha=None, extra={"source": "x.jsonl"})
    path = write_manifest(tmp_path, m)
    assert path.name == "manifest.json" and read_manifest(tmp_path) == m == read_manifest(path)
    assert re.match(r"\d{4}-\d\d-\d\dT", m.created)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["features-00000.safetensors", "manifest.json"]


def _write_raw(tmp_path, tmp_manifest, **changes):
    raw = tmp_manifest.to_dict()
    for key, value in changes.items():
        if value is KeyError:
            del raw[key]
        else:
            raw[key] = value
    (tmp_path / "manifest.json").write_text(json.dumps(raw))


@pytest.mark.parametrize(
    "changes, field, problem",
    [
        ({"max_length": KeyError}, "max_length", "missing required field"),
        ({"max_length": "64"}, "max_length", "expected int, found str"),
        ({"num_samples": True}, "num_samples", "expected int, found bool"),
        ({"target_revision": 3}, "target_revision", "expected str or null"),
        ({"layer_ids": [2, "x"]}, "layer_ids", "list of ints"),
        ({"colour": "red"}, "colour", "unknown field"),
        ({"version": 99}, "version", "unknown version 99"),
        ({"shards": [{"file": "a", "rows": "3", "sha256": "x"}]}, "shards[0].rows", "expected int"),
        ({"shards": [{"file": "a"}]}, "shards[0]", "expected an object with keys"),
    ],
)
def test_read_names_the_file_and_the_bad_field(tmp_path, changes, field, problem):
    _write_raw(tmp_path, _manifest(tmp_path), **changes)
    with pytest.raises(BadInputError) as err:
        read_manifest(tmp_path)
    assert err.value.path == str(tmp_path / "manifest.json") and err.value.field == field
    assert problem in err.value.problem


def test_read_refuses_missing_bad_json_and_inconsistent_counts(tmp_path):
    with pytest.raises(BadInputError, match="no manifest here"):
        read_manifest(tmp_path)
    for folder in (tmp_path, tmp_path / "not-made-yet"):  # a folder, made or not: the file it lacks is named
        with pytest.raises(BadInputError) as err:
            read_manifest(folder)
        assert err.value.path == str(folder / "manifest.json")
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(BadInputError, match="manifest.json: not valid JSON"):
        read_manifest(tmp_path)
    _write_raw(tmp_path, _manifest(tmp_path), num_samples=5)
    with pytest.raises(BadInputError, match="shards hold 3 rows but num_samples=5"):
        read_manifest(tmp_path)
    _write_raw(tmp_path, _manifest(tmp_path), kind="pictures")
    with pytest.raises(BadInputError, match="kind must be one of"):
        read_manifest(tmp_path)


def test_check_passes_on_a_match_and_lists_every_difference(tmp_path):
    found = _manifest(tmp_path)
    check(found, _manifest(tmp_path, num_samples=0, num_tokens=0, shards=[]))  # counts are not identity
    check(found, {"layer_ids": (2, 3, 4), "dtype": "bfloat16"})  # a tuple from a config equals the JSON list
    with pytest.raises(ManifestMismatchError) as err:
        check(found, _manifest(tmp_path, dtype="float16", layer_ids=[1, 2, 3]), where="run/manifest.json")
    message = str(err.value)
    assert message.startswith("run/manifest.json does not match")
    assert "dtype: expected 'float16' vs found 'bfloat16'" in message
    assert "layer_ids: expected [1, 2, 3] vs found [2, 3, 4]" in message and "max_length" not in message
    with pytest.raises(ManifestMismatchError, match="num_samples: expected 4 vs found 3"):
        check(found, {"num_samples": 4})
    with pytest.raises(ValueError, match="not manifest fields"):
        check(found, {"colour": "red"})


def test_verify_shards_finds_corrupt_and_missing_files(tmp_path):
    m = _manifest(tmp_path)
    verify_shards(m, tmp_path)
    shard = tmp_path / m.shards[0].file
    shard.write_bytes(b"flipped bits")
    with pytest.raises(BadInputError, match="checksum mismatch") as err:
        verify_shards(m, tmp_path)
    assert err.value.path == str(shard) and err.value.field == "sha256"
    shard.unlink()
    with pytest.raises(BadInputError, match="missing"):
        verify_shards(m, tmp_path)


def test_manifest_refuses_inconsistent_construction():
    with pytest.raises(ValueError, match="kind"):
        Manifest(kind="pixels", target_id="t", tokenizer_hash="h", max_length=8, dtype="int32")
    with pytest.raises(ValueError, match="layer_ids"):
        Manifest(kind="features", target_id="t", tokenizer_hash="h", max_length=8, dtype="bfloat16")
    tokens = Manifest(kind="tokens", target_id="t", tokenizer_hash="h", max_length=8, dtype="int32")
    assert tokens.layer_ids == [] and tokens.hidden_size is None


class _Tok:
    """A slow (non-fast) tokenizer stand-in: vocab, no merges, no added tokens."""

    is_fast, added_tokens_decoder, special_tokens_map = False, {}, {"eos_token": "<eos>"}

    def __init__(self, vocab, template=None):
        self.vocab, self.chat_template = vocab, template

    def get_vocab(self):
        return dict(self.vocab)


def test_tokenizer_and_template_hashes():
    a, b = _Tok({"x": 0, "y": 1}, "{{ m }}"), _Tok({"y": 1, "x": 0}, "{{ m }}")
    assert tokenizer_hash(a) == tokenizer_hash(b) and len(tokenizer_hash(a)) == 64
    assert tokenizer_hash(_Tok({"x": 1, "y": 0})) != tokenizer_hash(a)
    assert chat_template_hash(a) == chat_template_hash(b) != chat_template_hash(_Tok({}, "{{ n }}"))
    assert chat_template_hash(_Tok({})) is None


def test_code_git_sha_never_fails(tmp_path, monkeypatch):
    sha = code_git_sha()
    assert sha is None or re.fullmatch(r"[0-9a-f]{40}", sha)
    assert code_git_sha(tmp_path) is None  # not a git checkout

    def no_git(*args, **kwargs):
        raise FileNotFoundError("git")

    monkeypatch.setattr(mf.subprocess, "run", no_git)
    assert code_git_sha() is None

    def hung(*args, **kwargs):
        raise subprocess.TimeoutExpired("git", mf.GIT_TIMEOUT_S)

    monkeypatch.setattr(mf.subprocess, "run", hung)
    assert code_git_sha() is None
