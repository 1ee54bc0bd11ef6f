"""The data stage end to end on a tiny random target saved to disk: corpus -> regenerated answers ->
token shards + manifest -> offline features; re-running skips, a changed recipe is refused."""

import logging
from dataclasses import replace

import pytest
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from tiny_models import save_chat_data

from specblock.data import prepare as prep
from specblock.data.config import FeaturesConfig, PrepareConfig, register_configs
from specblock.data.corpora import CorpusConfig
from specblock.data.manifest import ManifestMismatchError, read_manifest
from specblock.data.regenerate import RegenerateConfig
from specblock.data.shards import TokenDataset
from specblock.data.target import TargetConfig


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
