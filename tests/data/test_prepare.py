"""The data stage end to end on a tiny random target saved to disk: corpus -> regenerated answers ->
token shards + manifest -> offline features; re-running skips, a changed recipe is refused."""

import json
import logging
from dataclasses import replace

import pytest
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from tiny_models import save_chat_data

from specblock.data import prepare as prep
from specblock.data import regenerate as regen
from specblock.data.config import FeaturesConfig, PrepareConfig, register_configs
from specblock.data.corpora import CorpusConfig
from specblock.data.errors import BadInputError
from specblock.data.manifest import ManifestMismatchError, read_manifest
from specblock.data.regenerate import RegenerateConfig
from specblock.data.shards import TokenDataset
from specblock.data.target import TargetConfig


def read_jsonl(path):
    return [json.loads(line) for line in open(path, encoding="utf-8")]


@pytest.fixture()
def setup(tiny_chat, tmp_path):
    bad = {"id": "bad", "conversations": [{"from": "human", "value": 3}]}
    save_chat_data(
        tiny_chat, tmp_path, ["what is the cat " * (1 + i) for i in range(5)], "the cat sat", (bad,)
    )

    def config(**kw):
        base = dict(
            out_dir=str(tmp_path / "out"),
            max_length=64,
            target=TargetConfig(name_or_path=str(tmp_path / "target"), dtype="float32"),
            corpus=CorpusConfig(source=str(tmp_path / "corpus.json"), on_bad_row="skip"),
            regenerate=RegenerateConfig(max_new_tokens=4, batch_size=2, max_prompt_tokens=20),
            features=FeaturesConfig(enabled=True, max_length=64, shard_rows=2, dtype="float16"),
        )
        return PrepareConfig(**{**base, **kw})

    return config


def test_prepare_end_to_end_then_skip_then_refuse(setup, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="specblock")
    result = prep.prepare(setup())
    out = caplog.text
    assert "skipped 3 bad rows" in out and "prompt longer than max_prompt_tokens=20" in out
    data = TokenDataset(result.tokens_dir)
    assert len(data) == result.num_rows == 3
    for row in data:
        assert row["input_ids"].shape == row["loss_mask"].shape and 0 < int(row["loss_mask"].sum()) < len(
            row["loss_mask"]
        )
    manifest = read_manifest(result.tokens_dir)
    assert manifest.extra["regenerate"]["enabled"] and manifest.max_length == 64
    assert read_manifest(result.features_dir).kind == "features"
    assert (result.tokens_dir.parent / "regenerated.jsonl").is_file()

    monkeypatch.setattr(prep, "regenerate", lambda *a, **k: pytest.fail("an up-to-date stage ran again"))
    caplog.clear()
    again = prep.prepare(setup())
    assert again.num_rows == 3 and "up to date" in caplog.text

    with pytest.raises(ManifestMismatchError, match="max_length: expected 48 vs found 64"):
        prep.prepare(setup(max_length=48, features=FeaturesConfig()))


def test_two_captures_of_one_data_folder_live_side_by_side(setup):
    """Recipes sharing a data folder but capturing differently (quick: the first rows; cpu_full: all) each
    keep their cache in `features.subdir`; the default folder's differing cache would be refused."""
    full = prep.prepare(setup())
    capped = setup(
        features=FeaturesConfig(
            enabled=True, subdir="features-first2", max_rows=2, max_length=64, dtype="float16"
        )
    )
    with pytest.raises(ManifestMismatchError, match="num_samples"):
        prep.prepare(replace(capped, features=replace(capped.features, subdir="features")))
    first = prep.prepare(capped)
    assert first.features_dir == full.features_dir.parent / "features-first2" != full.features_dir
    assert read_manifest(first.features_dir).num_samples == 2 < read_manifest(full.features_dir).num_samples
    assert prep.prepare(setup()).features_dir == full.features_dir  # both stay up to date
    for bad in ("", "a/b", "..", "tokens"):
        with pytest.raises(ValueError, match="features.subdir"):
            FeaturesConfig(subdir=bad)


def test_a_hub_subset_enters_the_recipe_only_when_set(setup, tiny_chat):
    """Shards written before `corpus.subset` existed record no such key; they must stay up to date."""
    _, tok = tiny_chat
    assert "subset" not in prep.expected_manifest(setup(), tok).extra["corpus"]
    cfg = setup(corpus=CorpusConfig(source="openai/gsm8k", subset="main"))
    assert prep.expected_manifest(cfg, tok).extra["corpus"]["subset"] == "main"


def test_the_regeneration_weight_layout_is_not_part_of_the_recipe(setup, tiny_chat):
    """Like the backend, the linear layers' kernel changes only the rounding: shards stay up to date."""
    _, tok = tiny_chat
    packed = setup()
    packed.regenerate = replace(packed.regenerate, weight_layout="packed")
    assert prep.expected_manifest(packed, tok) == prep.expected_manifest(setup(), tok)
    assert "weight_layout" not in prep.expected_manifest(packed, tok).extra["regenerate"]


def test_the_prepare_config_composes_and_validates():
    register_configs()
    with initialize_config_module("specblock.configs", version_base=None):
        cfg = compose("prepare", overrides=["data=sharegpt_raw", "data.corpus.limit=8", "target=tiny_random"])
    config = OmegaConf.to_object(cfg).data
    assert config.target.name_or_path.endswith("tiny-random-llama")
    assert isinstance(config, PrepareConfig) and config.corpus.limit == 8 and not config.regenerate.enabled
    assert config.out_dir == "checkpoints/data/sharegpt-raw"
    with initialize_config_module("specblock.configs", version_base=None):
        with pytest.raises(Exception, match="max_length"):
            OmegaConf.to_object(compose("prepare", overrides=["data.max_length=2"]))


def _qa_file(path, questions):
    path.write_text("".join(json.dumps({"question": q, "answer": "four"}) + "\n" for q in questions))
    return path


def test_a_mixture_is_spread_among_the_rows_and_enters_the_recipe(setup, tiny_chat, tmp_path):
    _, tok = tiny_chat
    assert "mix" not in prep.expected_manifest(setup(), tok).extra  # shards made before data.mix stay valid
    qa = _qa_file(tmp_path / "math.jsonl", ["two plus two", "one plus three"])
    cfg = setup(mix=[CorpusConfig(source=str(qa), format="qa")], features=FeaturesConfig())
    assert prep.expected_manifest(cfg, tok).extra["mix"][0]["source"] == str(qa)
    result = prep.prepare(cfg)
    ids = [row["id"] for row in read_jsonl(result.tokens_dir.parent / "regenerated.jsonl")]
    # spread among the five drawn conversations (r0 r1 r2 q0 r3 r4 q1), then the prompt filter drops r3, r4
    assert ids == ["r0", "r1", "r2", "math.jsonl:0", "math.jsonl:1"]
    with pytest.raises(ManifestMismatchError, match="extra"):  # another mixture: the shards are refused
        prep.prepare(
            setup(mix=[CorpusConfig(source=str(qa), format="qa", limit=1)], features=FeaturesConfig())
        )
    twice = setup(mix=[CorpusConfig(source=str(qa), format="qa")] * 2, out_dir=str(tmp_path / "twice"))
    with pytest.raises(BadInputError, match="math.jsonl:0.*unique over data.corpus and data.mix"):
        prep.prepare(twice)


def test_reused_answers_must_come_from_the_same_settings(setup, tmp_path, monkeypatch, caplog):
    first = prep.prepare(setup(features=FeaturesConfig()))
    earlier = first.tokens_dir.parent
    monkeypatch.setattr(
        regen, "generate_batch", lambda *a, **k: pytest.fail("a reused answer was regenerated")
    )
    again = setup(out_dir=str(tmp_path / "again"), features=FeaturesConfig())
    again.regenerate = replace(again.regenerate, reuse=[str(earlier)])
    result = prep.prepare(again)
    assert read_jsonl(result.tokens_dir.parent / "regenerated.jsonl") == read_jsonl(
        earlier / "regenerated.jsonl"
    )
    other = replace(again, out_dir=str(tmp_path / "other"))
    other.regenerate = replace(again.regenerate, max_new_tokens=3)
    with pytest.raises(ManifestMismatchError, match="regenerate.max_new_tokens: expected 3 vs found 4"):
        prep.prepare(other)
    bare = tmp_path / "bare.jsonl"  # a file with no token manifest beside it: taken on trust, with a warning
    bare.write_bytes((earlier / "regenerated.jsonl").read_bytes())
    other.regenerate = replace(again.regenerate, reuse=[str(bare)])
    caplog.set_level(logging.WARNING, logger="specblock")
    prep.prepare(replace(other, out_dir=str(tmp_path / "bare")))
    assert "cannot be checked" in caplog.text


def test_the_gsm8k_mixture_reads_local_copies_when_told_and_the_hub_otherwise(monkeypatch, tmp_path):
    register_configs()
    for root, source in ((None, "openai/gsm8k"), (str(tmp_path), str(tmp_path / "gsm8k" / "train.jsonl"))):
        if root is None:
            monkeypatch.delenv("SPECBLOCK_DATASETS", raising=False)
        else:
            monkeypatch.setenv("SPECBLOCK_DATASETS", root)
        with initialize_config_module("specblock.configs", version_base=None):
            config = OmegaConf.to_object(compose("prepare", overrides=["data=mix_6k_gsm8k"])).data
        (math,) = config.mix
        assert (math.source, math.format, math.split, math.subset, math.limit) == (
            source,
            "qa",
            "train",
            "main",
            1000,
        )
        assert config.corpus.limit == 7200 and config.regenerate.reuse == [
            "checkpoints/data/smollm2-sharegpt-regen-6k"
        ]
