"""Adding a drafter is one module and one YAML: the toy drafter (tests/support/toy_drafter.py and
tests/support/configs/drafter/toy.yaml) is composed by Hydra over its own schema, trained by the
training stage, exported, loaded back and decoded by the evaluation stage, whose greedy speculative
decoding reproduces the target's greedy decoding."""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

import toy_drafter  # tests/support: registers the toy with both stages
from specblock.evaluate.config import EvalConfig
from specblock.evaluate.run import evaluate
from specblock.train import run as train_run
from specblock.train.config import register_configs
from specblock.train.export import load_drafter

from tiny_models import save_chat_data

SEARCH_PATH = Path(toy_drafter.__file__).parent / "configs"
FIXTURES = Path(__file__).parent / "data" / "fixtures" / "evalsets"


def compose_train(overrides: list[str]):
    register_configs()
    with initialize_config_module("specblock.configs", version_base=None):
        return compose("train", overrides=[f"hydra.searchpath=[file://{SEARCH_PATH}]", *overrides])


def test_toy_drafter_trains_exports_and_decodes_greedy_exactly(tiny_chat, tmp_path):
    target, corpus = save_chat_data(
        tiny_chat, tmp_path, ["what is the cat", "why the dog ran"], "the cat sat on the mat"
    )
    cfg = compose_train(
        [
            "experiment=debug",
            "drafter=toy",
            f"data.target.name_or_path={target}",
            f"data.corpus.source={corpus}",
            f"data.out_dir={tmp_path / 'data'}",
            f"output_dir={tmp_path / 'run'}",
            "drafter.draft_vocab_size=24",
            "trainer.max_steps=3",
            "trainer.save_every=3",
            "trainer.micro_batch_size=2",
        ]
    )
    config = OmegaConf.to_object(cfg)
    assert isinstance(config.drafter, toy_drafter.ToyConfig) and config.run_name == "debug-toy"
    metrics = train_run.train(config, OmegaConf.to_container(cfg, resolve=True))
    assert metrics["step"] == 3 and metrics["train/loss"] > 0
    drafter, meta = load_drafter(tmp_path / "run" / "drafter")
    assert isinstance(drafter, toy_drafter.ToyDrafter) and meta["architecture"] == "toy"
    rows = evaluate(
        EvalConfig(
            output_dir=str(tmp_path / "eval"),
            target=config.data.target,
            drafters={"toy": str(tmp_path / "run" / "drafter")},
            methods=["autoregressive", "chain-token", "iid-spectr", "tree"],
            datasets=["mt_bench"],
            local_root=str(FIXTURES),
            limit=2,
            max_new_tokens=8,
        )
    )
    overall = {r["method"]: r for r in rows if r["dataset"] == "overall"}
    assert set(overall) == {"autoregressive", "toy:chain-token", "toy:iid-spectr", "toy:tree"}
    assert all(r["greedy_mismatches"] == 0 for r in overall.values())
    assert overall["toy:tree"]["counts"]["drafter_calls"] > 0


def test_a_key_the_drafter_does_not_have_is_refused():
    with pytest.raises(Exception, match="rank_hidden"):
        compose_train(["drafter=toy", "drafter.rank_hidden=8"])
