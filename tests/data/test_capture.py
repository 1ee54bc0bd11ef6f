import logging
from dataclasses import replace

import pytest
import torch
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

from specblock.data.capture import (
    CaptureConfig,
    CaptureTooLargeError,
    bytes_per_token,
    capture_features,
    load_feature_rows,
)
from specblock.data.errors import BadInputError
from specblock.data.io import sha256_file
from specblock.data.manifest import (
    Manifest,
    ManifestMismatchError,
    chat_template_hash,
    check,
    read_manifest,
    tokenizer_hash,
    verify_shards,
)
from specblock.data.target import FeatureTarget

from tiny_models import Interrupting, tiny_llama

VOCAB, HIDDEN, LAYERS = 100, 32, 4


@pytest.fixture(scope="module")
def target() -> FeatureTarget:
    return FeatureTarget(tiny_llama(VOCAB, layers=LAYERS), target_id="tiny-llama")


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    backend = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="w0", chat_template="{{ messages }}")


def make_rows(n: int, seed: int = 0, max_len: int = 20) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        length = int(torch.randint(2, max_len, (1,), generator=g))
        ids = torch.randint(0, VOCAB, (length,), generator=g).tolist()
        rows.append({"input_ids": ids, "loss_mask": [int(i >= length // 2) for i in range(length)]})
    return rows


def test_capture_stores_features_that_match_the_target(tmp_path, target, tokenizer, caplog):
    caplog.set_level(logging.INFO, logger="specblock")
    rows = make_rows(7)
    rows[3] = {"input_ids": list(range(30)), "loss_mask": [1] * 30}  # longer than max_length: truncated
    cfg = CaptureConfig(max_length=16, batch_size=2, shard_rows=3)
    out = capture_features(target, rows, tmp_path / "feat", cfg, tokenizer=tokenizer, source="toy.jsonl")
    assert "7 rows" in caplog.text
    manifest = read_manifest(out)
    assert [s.file for s in manifest.shards] == [f"features-0000{i}.safetensors" for i in range(3)]
    assert [s.rows for s in manifest.shards] == [3, 3, 1] and manifest.num_samples == 7
    assert manifest.layer_ids == [2, 2, 1] and manifest.hidden_size == HIDDEN and manifest.dtype == "bfloat16"
    assert manifest.tokenizer_hash == tokenizer_hash(tokenizer) and manifest.target_id == "tiny-llama"
    assert manifest.num_tokens == sum(min(len(r["input_ids"]), 16) for r in rows)
    verify_shards(manifest, out)
    stored = [row for shard in manifest.shards for row in load_feature_rows(out / shard.file)]
    assert [r["row_index"] for r in stored] == list(range(7))
    for row, r in zip(rows, stored):
        ids = torch.tensor(row["input_ids"][:16])
        assert torch.equal(r["input_ids"], ids)
        assert r["loss_mask"].tolist() == [bool(m) for m in row["loss_mask"][:16]]
        alone = target(ids[None])  # one unpadded row in float32; stored values are bf16
        assert r["features"].dtype == torch.bfloat16 and r["features"].shape == (len(ids), 3 * HIDDEN)
        torch.testing.assert_close(r["features"].float(), alone.features[0], atol=2e-2, rtol=2e-2)
        logits = target.logits_from_hidden(r["last_hidden"].float())  # recomputed through the frozen head
        torch.testing.assert_close(logits, alone.logits[0], atol=5e-2, rtol=5e-2)


def test_bad_rows_error_or_are_skipped_and_counted(tmp_path, target, tokenizer, caplog):
    caplog.set_level(logging.INFO, logger="specblock")
    rows = make_rows(5)
    rows[1] = {"input_ids": [1, 2, 3], "loss_mask": [1, 1]}
    rows[3] = {"input_ids": [1, VOCAB + 5], "loss_mask": [0, 1]}
    with pytest.raises(BadInputError) as err:
        capture_features(target, rows, tmp_path / "a", tokenizer=tokenizer, source="toy.jsonl")
    assert str(err.value) == "toy.jsonl, row 1, field 'loss_mask': length 2 != len(input_ids) 3"
    assert not (tmp_path / "a").exists()
    skip = CaptureConfig(on_bad_row="skip")
    out = capture_features(target, rows, tmp_path / "b", skip, tokenizer=tokenizer)
    assert "skipped 2 bad rows" in caplog.text
    assert [r["row_index"] for r in load_feature_rows(out / "features-00000.safetensors")] == [0, 2, 4]
    with pytest.raises(BadInputError, match="row 0, field 'input_ids': missing"):
        capture_features(target, [{"loss_mask": [1]}], tmp_path / "c", tokenizer=tokenizer)


def test_max_gb_refuses_before_writing_and_max_rows_caps(tmp_path, target, tokenizer, caplog):
    caplog.set_level(logging.INFO, logger="specblock")
    rows = make_rows(6, max_len=10)
    per_token = bytes_per_token(3, HIDDEN, "float16")
    assert per_token == 4 * HIDDEN * 2 + 5
    first_three = sum(len(r["input_ids"]) for r in rows[:3]) * per_token
    cfg = CaptureConfig(dtype="float16", max_gb=first_three / 1e9)
    with pytest.raises(CaptureTooLargeError, match="set max_rows=3 to capture the rows that fit"):
        capture_features(target, rows, tmp_path / "f", cfg, tokenizer=tokenizer)
    assert "GB" in caplog.text and not (tmp_path / "f").exists()
    capped = CaptureConfig(dtype="float16", max_gb=cfg.max_gb, max_rows=3)
    out = capture_features(target, rows, tmp_path / "f", capped, tokenizer=tokenizer)
    assert read_manifest(out).num_samples == 3


def test_ctrl_c_leaves_whole_shards_and_a_rerun_resumes(tmp_path, target, tokenizer):
    rows, cfg = make_rows(8), CaptureConfig(batch_size=2, shard_rows=2)
    out = tmp_path / "feat"
    with pytest.raises(KeyboardInterrupt):
        capture_features(Interrupting(target, stop_at=3), rows, out, cfg, tokenizer=tokenizer)
    assert sorted(p.name for p in out.iterdir()) == [f"features-0000{i}.safetensors" for i in (0, 1)]
    resumed = Interrupting(target)
    capture_features(resumed, rows, out, cfg, tokenizer=tokenizer)
    assert resumed.calls == 2  # only shards 2 and 3 were computed
    fresh = capture_features(target, rows, tmp_path / "fresh", cfg, tokenizer=tokenizer)
    assert read_manifest(out).shards == read_manifest(fresh).shards  # same files, same sha256
    again = Interrupting(target)
    capture_features(again, rows, out, cfg, tokenizer=tokenizer)
    assert again.calls == 0  # complete: nothing to do


def test_resume_and_rerun_refuse_other_inputs_or_settings(tmp_path, target, tokenizer):
    rows, cfg = make_rows(6), CaptureConfig(batch_size=3, shard_rows=3)
    out = tmp_path / "feat"
    with pytest.raises(KeyboardInterrupt):
        capture_features(Interrupting(target, stop_at=2), rows, out, cfg, tokenizer=tokenizer)
    with pytest.raises(BadInputError, match="features-00000.safetensors, field 'fingerprint'"):
        capture_features(target, make_rows(6, seed=1), out, cfg, tokenizer=tokenizer)
    capture_features(target, rows, out, cfg, tokenizer=tokenizer)
    with pytest.raises(ManifestMismatchError, match="dtype: expected 'float16' vs found 'bfloat16'"):
        capture_features(
            target, rows, out, CaptureConfig(dtype="float16", batch_size=3, shard_rows=3), tokenizer=tokenizer
        )
    shifted = [(t + 1) % VOCAB for t in rows[4]["input_ids"]]
    edited = rows[:4] + [{**rows[4], "input_ids": shifted}] + rows[5:]  # same counts, other ids in shard 1
    with pytest.raises(BadInputError, match="features-00001.safetensors, field 'fingerprint'"):
        capture_features(target, edited, out, cfg, tokenizer=tokenizer)
    with pytest.raises(ManifestMismatchError, match="another shard_rows"):
        capture_features(target, rows, out, CaptureConfig(batch_size=3, shard_rows=2), tokenizer=tokenizer)
    manifest = read_manifest(out)
    with pytest.raises(ManifestMismatchError, match=r"layer_ids: expected \[1, 2, 3\] vs found \[2, 2, 1\]"):
        check(manifest, {"layer_ids": [1, 2, 3]})
    shard = out / manifest.shards[0].file
    assert sha256_file(shard) == manifest.shards[0].sha256


def test_capture_config_validates():
    with pytest.raises(ValueError, match="capture.dtype"):
        CaptureConfig(dtype="float32")
    with pytest.raises(ValueError, match="max_gb"):
        CaptureConfig(max_gb=0)
    with pytest.raises(ValueError, match="on_bad_row"):
        CaptureConfig(on_bad_row="ignore")


def test_rows_from_another_tokenizer_are_refused(tmp_path, target, tokenizer):
    tokens = Manifest(
        kind="tokens",
        target_id="tiny-llama",
        tokenizer_hash=tokenizer_hash(tokenizer),
        chat_template_hash=chat_template_hash(tokenizer),
        max_length=64,
        dtype="int32",
    )
    other = replace(tokens, tokenizer_hash="0" * 64)
    with pytest.raises(ManifestMismatchError, match="tok/manifest.json manifest does not match") as err:
        capture_features(
            target,
            make_rows(2),
            tmp_path / "f",
            tokenizer=tokenizer,
            source="tok/manifest.json",
            tokens_manifest=other,
        )
    assert f"tokenizer_hash: expected '{tokenizer_hash(tokenizer)}' vs found '{'0' * 64}'" in str(err.value)
    out = capture_features(target, make_rows(2), tmp_path / "f", tokenizer=tokenizer, tokens_manifest=tokens)
    assert read_manifest(out).extra["tokens_manifest"] == {"created": tokens.created, "num_samples": 0}


def test_a_full_disk_leaves_no_half_written_shard_and_a_rerun_resumes(
    tmp_path, target, tokenizer, monkeypatch
):
    import errno

    from specblock.data import capture

    rows, cfg, out = make_rows(6), CaptureConfig(batch_size=2, shard_rows=2), tmp_path / "feat"
    real_save, calls = capture.save_file, []

    def filling_disk(tensors, path, metadata=None):
        calls.append(path)
        if len(calls) == 2:  # the second shard: part of the bytes land, then the disk is full
            with open(path, "wb") as f:
                f.write(b"\0" * 100)
            raise OSError(errno.ENOSPC, "No space left on device", path)
        real_save(tensors, path, metadata=metadata)

    monkeypatch.setattr(capture, "save_file", filling_disk)
    with pytest.raises(OSError, match="No space left"):
        capture_features(target, rows, out, cfg, tokenizer=tokenizer)
    # only the complete first shard is there: no partial shard, no temporary file, no manifest
    assert sorted(p.name for p in out.iterdir()) == ["features-00000.safetensors"]
    monkeypatch.setattr(capture, "save_file", real_save)
    capture_features(target, rows, out, cfg, tokenizer=tokenizer)
    fresh = capture_features(target, rows, tmp_path / "fresh", cfg, tokenizer=tokenizer)
    assert read_manifest(out).shards == read_manifest(fresh).shards


def test_cut_repeats_captures_rows_cut_where_their_answers_repeat(tmp_path, target, tokenizer, caplog):
    """capture.cut_repeats=n stores each row as data/repeats.cut_at_repeat keeps it (the same tokens training's
    cut_repeats would keep), max_rows counts those rows, the manifest names n and a cache of whole rows is
    refused for it (and the other way round), naming the field."""
    from specblock.data.repeats import cut_at_repeat

    caplog.set_level(logging.INFO, logger="specblock")
    rows = make_rows(5, max_len=12)
    rows[1] = {
        "input_ids": [7, 8, 9, 3, 4, 3, 4, 3, 4, 5],
        "loss_mask": [0, 0, 0] + [1] * 7,
    }  # "3 4" again at 6
    rows[3] = {"input_ids": [1, 2] + [5] * 20, "loss_mask": [0, 0] + [1] * 20}  # truncated, then cut
    cfg = CaptureConfig(max_length=16, batch_size=2, shard_rows=2, cut_repeats=2, max_rows=4)
    out = capture_features(target, rows, tmp_path / "cut", cfg, tokenizer=tokenizer)
    manifest = read_manifest(out)
    stored = [row for shard in manifest.shards for row in load_feature_rows(out / shard.file)]
    assert [r["row_index"] for r in stored] == [0, 1, 2, 3]  # max_rows: 4 rows, cut
    for row, r in zip(rows, stored):
        ids, mask = row["input_ids"][:16], row["loss_mask"][:16]
        keep = cut_at_repeat(ids, mask, 2)
        assert r["input_ids"].tolist() == ids[:keep] and len(r["features"]) == keep
        assert cut_at_repeat(r["input_ids"].tolist(), r["loss_mask"].long().tolist(), 2) == keep  # idempotent
    assert len(stored[1]["input_ids"]) == 6 and len(stored[3]["input_ids"]) == 4
    assert manifest.cut_repeats == 2 and manifest.num_tokens == sum(len(r["input_ids"]) for r in stored)
    assert "cut where their answer repeats a 2-token span" in caplog.text
    alone = target(stored[1]["input_ids"][None])  # features of the cut row itself
    torch.testing.assert_close(stored[1]["features"].float(), alone.features[0], atol=2e-2, rtol=2e-2)
    capture_features(target, rows, out, cfg, tokenizer=tokenizer)  # complete: nothing to do
    with pytest.raises(ManifestMismatchError, match="cut_repeats: expected 0 vs found 2"):
        capture_features(target, rows, out, replace(cfg, cut_repeats=0), tokenizer=tokenizer)
    whole = capture_features(
        target, rows, tmp_path / "whole", replace(cfg, cut_repeats=0), tokenizer=tokenizer
    )
    with pytest.raises(ManifestMismatchError, match="cut_repeats: expected 2 vs found 0"):
        capture_features(target, rows, whole, cfg, tokenizer=tokenizer)
    with pytest.raises(ValueError, match="cut_repeats"):
        CaptureConfig(cut_repeats=-1)


def test_a_manifest_without_cut_repeats_reads_as_whole_rows(tmp_path, target, tokenizer):
    """Caches written before capture.cut_repeats existed (no such manifest field) stay valid: read as 0, and
    their shards' fingerprints are the ones a whole-row capture computes today."""
    import json

    rows, cfg = make_rows(4), CaptureConfig(batch_size=2, shard_rows=2)
    out = capture_features(target, rows, tmp_path / "old", cfg, tokenizer=tokenizer)
    path = out / "manifest.json"
    raw = json.loads(path.read_text())
    del raw["cut_repeats"]
    path.write_text(json.dumps(raw))
    assert read_manifest(out).cut_repeats == 0
    capture_features(target, rows, out, cfg, tokenizer=tokenizer)  # accepted as complete
    (out / "manifest.json").unlink()  # resume path: every shard's fingerprint is checked, none recaptured
    before = {p.name: sha256_file(p) for p in out.glob("features-*.safetensors")}
    capture_features(target, rows, out, cfg, tokenizer=tokenizer)
    assert {p.name: sha256_file(p) for p in out.glob("features-*.safetensors")} == before
