"""The training stage end to end on a tiny random target (the stage's one slow test): data -> train ->
export -> load back; a run killed mid-way and resumed ends bit-identical to an uninterrupted one;
offline features and the EAGLE-3 baseline go through the same loop."""

import dataclasses
import importlib.resources
import logging
import json
import os
import shutil
from pathlib import Path


import pytest
import torch
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from specblock.data.config import FeaturesConfig, PrepareConfig
from specblock.data.corpora import CorpusConfig
from specblock.data.regenerate import RegenerateConfig
from specblock.data.target import TargetConfig
from specblock.train import run as run_mod
from specblock.train.checkpoint import read_model_state
from specblock.train.config import TrainConfig, ValidationConfig, register_configs, saved_run_config
from specblock.train.drafters import train_spec
from specblock.train.export import load_drafter
from specblock.train.losses import CurriculumConfig, LossConfig
from specblock.train.distill import StrategyConfig
from specblock.train.modeling import Eagle3Config, SpecBlockConfig
from specblock.train.trainer import TrainerConfig
from specblock.train.validation import read_best, split_indices

STEPS = 6


@pytest.fixture()
def make_cfg(tiny_chat, tmp_path):
    model, tok = tiny_chat
    model.save_pretrained(tmp_path / "target")
    tok.save_pretrained(tmp_path / "target")
    words = "the cat sat on the mat and the dog ran fast".split()
    rows = [
        {
            "id": f"r{i}",
            "conversations": [
                {"from": "human", "value": " ".join(words[i % 5 : i % 5 + 4])},
                {"from": "gpt", "value": " ".join(words[(i * 3) % 7 :])},
            ],
        }
        for i in range(12)
    ]
    (tmp_path / "corpus.json").write_text(json.dumps(rows))

    def make(name="specblock", out="run", features="online", validation=None, **trainer):
        data = PrepareConfig(
            out_dir=str(tmp_path / "data"),
            max_length=64,
            target=TargetConfig(name_or_path=str(tmp_path / "target"), dtype="float32"),
            corpus=CorpusConfig(source=str(tmp_path / "corpus.json")),
            regenerate=RegenerateConfig(enabled=False),
            features=FeaturesConfig(enabled=features == "offline", max_length=64, dtype="float16"),
        )
        t = dict(
            output_dir=str(tmp_path / out),
            max_steps=STEPS,
            micro_batch_size=4,
            save_every=3,
            log_every=1,
            mixed_precision="no",
        )
        return TrainConfig(
            run_name=out,
            output_dir=str(tmp_path / out),
            features=features,
            data=data,
            drafter=SpecBlockConfig(draft_vocab_size=24, rank_hidden=16)
            if name == "specblock"
            else Eagle3Config(draft_vocab_size=24, ttt_length=3),
            loss=LossConfig(curriculum=CurriculumConfig(end=3), rank_start_step=2),
            strategy=StrategyConfig(num_ttt_blocks=2),
            validation=validation or ValidationConfig(),
            trainer=TrainerConfig(**{**t, **trainer}),
        )

    return make


def train_killed_after(cfg, step, monkeypatch):
    """Run `cfg` until `step` optimizer steps are done, then die as a killed process would."""
    from specblock.train import trainer as trainer_mod

    real_step = trainer_mod._train_step

    def dying(run, *a, **k):
        if run.progress.step == step:
            raise KeyboardInterrupt
        return real_step(run, *a, **k)

    with monkeypatch.context() as m:
        m.setattr(trainer_mod, "_train_step", dying)
        with pytest.raises(KeyboardInterrupt):
            run_mod.train(cfg)


def params(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def test_train_export_reload_and_exact_resume(make_cfg, monkeypatch):
    cfg = make_cfg()
    metrics = run_mod.train(cfg)
    assert metrics["step"] == STEPS and metrics["train/loss"] > 0 and "train/accept_len" in metrics
    drafter, config = load_drafter(cfg.output_dir + "/drafter")
    assert config["block_size"] == 4 and config["draft_vocab_size"] == 24
    built = run_mod.build(cfg)
    strategy, rows = built.strategy, built.rows
    strategy.module.load_state_dict(drafter.state_dict())
    batch = built.collate_fn([rows[0], rows[1]])
    with torch.no_grad():
        features, _ = strategy.target_outputs(batch)
        args = (features[:, :-1], batch["input_ids"][:, 1:], batch["attention_mask"][:, 1:])
        assert torch.equal(
            drafter(*args).logits, strategy.module(*args).logits
        )  # export -> load: same logits
    reference = params(drafter)
    with pytest.raises(FileExistsError, match="trainer.resume=latest"):  # a fresh run into a used folder
        run_mod.train(make_cfg())

    # killed after step 4 (the checkpoint at step 3 survives), then resumed: bit-identical parameters
    train_killed_after(make_cfg(out="killed"), 4, monkeypatch)
    resumed = make_cfg(out="killed", resume="latest")
    run_mod.train(resumed)
    again, _ = load_drafter(resumed.output_dir + "/drafter")
    for k, v in params(again).items():
        assert torch.equal(v, reference[k]), k

    # python -m specblock.train.export: re-export an earlier checkpoint of the run
    from specblock.train.export import main as export_main

    export_main(["--run", cfg.output_dir, "--step", "step_000003", "--out", cfg.output_dir + "/at3"])
    at3, _ = load_drafter(cfg.output_dir + "/at3")
    assert not torch.equal(at3.state_dict()["condition_proj.weight"], reference["condition_proj.weight"])


def test_a_run_stopped_by_its_minute_budget_exports_the_step_it_reached(make_cfg, monkeypatch):
    """trainer.max_minutes (here through the Hydra override) ends the run early, saved and exported."""
    from specblock.train import trainer as trainer_mod

    now = [0.0]

    def clock():  # 20 s a step: start and end of each step 20 s apart
        now[0] += 20.0
        return now[0]

    monkeypatch.setattr(trainer_mod, "_clock", clock)
    assert compose_train("experiment=debug", "trainer.max_minutes=0.9")["trainer"]["max_minutes"] == 0.9
    cfg = make_cfg(max_minutes=0.9)  # 0.9 min = 54 s: stops after step 3 (60 s) of 6
    metrics = run_mod.train(cfg)
    assert metrics["step"] == 3
    assert "- steps: 3" in (Path(cfg.output_dir) / "drafter" / "README.md").read_text()
    exported, _ = load_drafter(cfg.output_dir + "/drafter")
    saved = read_model_state(Path(cfg.trainer.output_dir) / "step_000003")
    assert all(torch.equal(v, saved[k]) for k, v in exported.state_dict().items())


@pytest.mark.parametrize("name,features", [("eagle3", "online"), ("specblock", "offline")])
def test_baseline_and_offline_features_run_the_same_loop(make_cfg, name, features):
    cfg = make_cfg(name=name, out=f"{name}-{features}", features=features, max_steps=2)
    if name == "eagle3":  # distinct layers (the 4-layer default [2, 2, 1] repeats one), unsorted
        cfg.data.target.feature_layers = [3, 1, 2]
    metrics = run_mod.train(cfg)
    assert metrics["step"] == 2 and torch.isfinite(torch.tensor(metrics["train/loss"]))
    # only EAGLE-3 has a serving-engine layout (tests/train/test_serving.py checks its contents)
    for suffix in ("vllm", "speculators"):
        folder = Path(cfg.output_dir) / f"drafter-{suffix}"
        assert (folder / "model.safetensors").exists() == (name == "eagle3")
    if features == "offline":  # the target's argmax was kept beside the cache, and every row carries it
        from specblock.data.target_argmax import ARGMAX_FILE

        features_dir = Path(cfg.data.out_dir) / "features"
        assert (features_dir / ARGMAX_FILE).is_file()
        built = run_mod.build(cfg)
        row = built.rows[0]
        full = built.strategy.head(row["last_hidden"], upcast=False)
        assert torch.equal(row["target_argmax"], full.max(-1).indices)


def test_a_run_initialised_from_an_exported_drafter_starts_from_its_weights(make_cfg):
    base = make_cfg(name="eagle3", out="base", max_steps=2)
    run_mod.train(base)
    exported, _ = load_drafter(base.output_dir + "/drafter")
    cfg = make_cfg(name="eagle3", out="tuned", max_steps=1)
    cfg.init_from = base.output_dir + "/drafter"
    built = run_mod.build(cfg)
    for k, v in exported.state_dict().items():  # the weights and the draft vocabulary (d2t) it came with
        assert torch.equal(built.strategy.module.state_dict()[k], v), k
    assert not torch.equal(  # a run without init_from starts from fresh weights
        run_mod.build(make_cfg(name="eagle3", out="fresh")).strategy.module.state_dict()["fc.weight"],
        exported.state_dict()["fc.weight"],
    )
    run_mod.train(cfg)
    assert (
        "initialised from: " + cfg.init_from in (Path(cfg.output_dir) / "drafter" / "README.md").read_text()
    )

    cfg = make_cfg(name="eagle3", out="wrong")
    cfg.drafter.draft_vocab_size, cfg.init_from = 20, base.output_dir + "/drafter"
    with pytest.raises(
        ValueError, match=r"config.json: init_from .*drafter.draft_vocab_size \(24 there, 20 here\)"
    ):
        run_mod.build(cfg)
    other = Path(base.output_dir) / "other-target"  # the same drafter, exported for another target
    shutil.copytree(base.output_dir + "/drafter", other)
    config = json.loads((other / "config.json").read_text())
    config["target"]["config"]["hidden_size"] = 999
    (other / "config.json").write_text(json.dumps(config))
    cfg = make_cfg(name="eagle3", out="wrong")
    cfg.init_from = str(other)
    with pytest.raises(ValueError, match=r"target.hidden_size \(999 there, \d+ here\)"):
        run_mod.build(cfg)
    cfg = make_cfg(name="specblock", out="wrong")
    cfg.init_from = base.output_dir + "/drafter"
    with pytest.raises(ValueError, match=r"architecture \('eagle3' there, 'specblock' here\)"):
        run_mod.build(cfg)


def test_init_layers_target_starts_the_decoder_layers_from_the_targets_top_layers(make_cfg, tiny_chat):
    cfg = make_cfg(name="specblock", out="from-target", max_steps=1)
    cfg.init_layers = "target"
    drafter = run_mod.build(cfg).strategy.module
    target = tiny_chat[0].model.layers
    n = len(drafter.layers)
    for mine, theirs in zip(drafter.layers, target[len(target) - n :]):
        for k, v in theirs.state_dict().items():
            assert torch.equal(mine.state_dict()[k], v), k
    run_mod.train(cfg)
    card = (Path(cfg.output_dir) / "drafter" / "README.md").read_text()
    assert "decoder layers initialised from: the target's top layers" in card
    with pytest.raises(ValueError, match="init_layers='target' would set its decoder layers too"):
        dataclasses.replace(cfg, init_from=cfg.output_dir + "/drafter")
    with pytest.raises(ValueError, match=r"init_layers='top' is not one of \('random', 'target'\)"):
        dataclasses.replace(cfg, init_layers="top")


def test_validation_keeps_and_exports_the_best_step(make_cfg, caplog):
    caplog.set_level(logging.INFO, logger="specblock.train")
    cfg = make_cfg(
        out="val",
        validation=ValidationConfig(fraction=0.25, seed=1),
        group_by_length=2,  # the run hands the rows' lengths to the trainer
        max_steps=6,
        eval_every=2,
        save_every=0,
        keep_last=1,
        best_metric="kl_0",
        best_mode="min",
        log_every=3,
    )
    metrics = run_mod.train(cfg)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
    # the console (and the job's log file) shows each logging window and each validation, not W&B only
    assert [line.split(":")[0] for line in lines] == [
        "step 2 validation", "step 3", "step 4 validation", "step 6", "step 6 validation"
    ]  # fmt: skip
    assert "top1_0 " in lines[1] and "lr " in lines[1] and "tok/s" in lines[1] and "accept_len" in lines[0]
    assert 0 < metrics["val/top1_0"] <= 1 and "val/accept_len" in metrics and "val/rank_acc_0" in metrics
    best = read_best(cfg.output_dir)
    assert best["metric"] == "val/kl_0" and best["step"] in (2, 4, 6)
    kept = sorted(p.name for p in Path(cfg.output_dir).glob("step_*"))
    assert kept == sorted({best["folder"], "step_000006"})  # keep_last=1 plus the best step
    card = (Path(cfg.output_dir) / "drafter" / "README.md").read_text()
    assert f"exported step: {best['step']}, the best by val/kl_0" in card
    exported, _ = load_drafter(cfg.output_dir + "/drafter")
    from specblock.train.checkpoint import read_model_state

    stored = read_model_state(Path(cfg.output_dir) / best["folder"])
    assert torch.equal(exported.state_dict()["lm_head.weight"], stored["lm_head.weight"])


def test_split_indices_is_seeded_and_disjoint():
    train, val = split_indices(20, 0.25, None, seed=3)
    assert len(val) == 5 and not set(train) & set(val) and sorted(train + val) == list(range(20))
    assert split_indices(20, 0.25, None, seed=3) == (train, val) and split_indices(20, 0.25, 2, 3)[1] != val
    assert split_indices(20, 0.0, None, 0) == (list(range(20)), [])
    with pytest.raises(ValueError, match="no training rows"):
        split_indices(2, 0.9, None, 0)


def options(group: str) -> list[str]:
    """The YAML options of a config group of the package's configs."""
    folder = importlib.resources.files("specblock.configs").joinpath(group)
    return sorted(p.name.removesuffix(".yaml") for p in folder.iterdir() if p.name.endswith(".yaml"))


EXPERIMENTS = options("experiment")


def test_experiments_are_discovered():
    assert {"debug", "quick", "gpu_8b", "cpu_full"} <= set(EXPERIMENTS)


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_composes_and_validates(experiment):
    register_configs()
    with initialize_config_module("specblock.configs", version_base=None):
        cfg = compose("train", overrides=[f"experiment={experiment}"])
    config = OmegaConf.to_object(cfg)
    assert isinstance(config, TrainConfig) and config.trainer.output_dir == config.output_dir
    config.trainer.check_milestones()  # what fit() checks first
    with initialize_config_module("specblock.configs", version_base=None):
        assert (
            OmegaConf.to_object(
                compose("train", overrides=[f"experiment={experiment}", "resume=latest"])
            ).trainer.resume
            == "latest"
        )


def compose_train(*overrides: str) -> dict:
    """configs/train.yaml composed with `overrides`, resolved into plain containers."""
    register_configs()
    with initialize_config_module("specblock.configs", version_base=None):
        return OmegaConf.to_container(compose("train", overrides=list(overrides)), resolve=True)


def test_experiment_drafter_files_name_an_experiment_and_a_drafter():
    """experiment_drafter/<experiment>_<drafter>.yaml is optional in train.yaml's defaults, so a misspelt
    name would be skipped without a word: each one must pair an existing experiment with a drafter."""
    pairs = {f"{e}_{d}" for e in EXPERIMENTS for d in options("drafter")}
    found = options("experiment_drafter")
    assert found and set(found) <= pairs


def test_quick_specialises_each_drafter_on_one_cut_cache():
    """The quick recipe gives SpecBlock one decoder layer and 820 steps on rows cut where they repeat
    (experiment_drafter/quick_specblock.yaml), EAGLE-3 240 on the same cut rows (quick_eagle3.yaml); both
    read one capped feature cache (the same data config: the first run captures, the second finds it);
    other experiments and command-line overrides are untouched."""
    sb, e3 = (compose_train("experiment=quick", f"drafter={d}") for d in ("specblock", "eagle3"))
    assert (sb["drafter"]["num_layers"], sb["trainer"]["max_steps"], sb["loss"]["curriculum"]["end"]) == (
        1,
        820,
        410,
    )
    # quick.yaml's cut, made by the trainer after reading the one shared cache
    assert sb["cut_repeats"] == e3["cut_repeats"] == 32
    assert e3["trainer"]["max_steps"] == 240 and e3["loss"]["curriculum"]["end"] == 120
    assert sb["trainer"]["micro_batch_size"] == e3["trainer"]["micro_batch_size"] == 4  # quick.yaml's, kept
    assert sb["features"] == e3["features"] == "offline" and sb["data"] == e3["data"]
    assert sb["data"]["features"]["enabled"] and sb["data"]["features"]["max_rows"] == 840
    # cpu_full captures every row of the same data folder: a cache of its own, or one recipe's would refuse
    # the other's
    full = compose_train("experiment=cpu_full")
    assert full["data"]["out_dir"] == sb["data"]["out_dir"]
    assert full["data"]["features"]["subdir"] != sb["data"]["features"]["subdir"]
    # SpecBlock's steps draw each captured training row about four times: its cut rows hold ~0.63 of the whole
    # rows' tokens (session 44), so about 2.6 passes over the whole rows' tokens
    val = sb["validation"]
    train_rows = len(
        split_indices(sb["data"]["features"]["max_rows"], val["fraction"], val["max_rows"], val["seed"])[0]
    )
    assert 3.5 < sb["trainer"]["max_steps"] * sb["trainer"]["micro_batch_size"] / train_rows < 4.5
    assert compose_train("experiment=quick", "trainer.max_steps=60")["trainer"]["max_steps"] == 60
    assert full["drafter"]["num_layers"] == 2 and full["trainer"]["max_steps"] == 600


def test_cpu_full_6k_is_cpu_full_on_more_data():
    """The 6k experiment changes the data (and the run's name) and nothing that training does."""
    base, more = (compose_train(f"experiment={e}") for e in ("cpu_full", "cpu_full_6k"))
    assert more["data"]["corpus"]["limit"] > base["data"]["corpus"]["limit"]
    assert more["data"]["out_dir"] != base["data"]["out_dir"] and more["run_name"] == "cpu_full_6k-specblock"
    assert more["data"]["regenerate"] == base["data"]["regenerate"]
    for key in ("trainer", "loss", "strategy", "validation", "drafter"):
        a, b = (dict(c[key]) for c in (base, more))
        for run_key in ("output_dir", "run_name"):
            a.pop(run_key, None), b.pop(run_key, None)
        assert a == b, key


def test_cpu_full_6k_more_continues_the_6k_drafter_on_the_same_data():
    """The warm restart reads the 6k run's exported drafter, trains on the same rows with the same
    held-out split (so validation stays comparable and unseen), the curriculum finished from step 0."""
    base, more = (compose_train(f"experiment={e}") for e in ("cpu_full_6k", "cpu_full_6k_more"))
    assert more["init_from"] == "checkpoints/cpu_full_6k-specblock/drafter"
    assert more["run_name"] == "cpu_full_6k_more-specblock" and more["data"] == base["data"]
    assert more["validation"] == base["validation"] and more["strategy"] == base["strategy"]
    assert more["loss"]["curriculum"]["end"] == 0
    assert more["trainer"]["optim"]["lr"] < base["trainer"]["optim"]["lr"]
    assert more["trainer"]["keep_every"] % more["trainer"]["save_every"] == 0


def test_a_resumed_run_remembers_its_best_validation_step(make_cfg, monkeypatch):
    # prefix_alpha rises with the step (curriculum end 3): with best_mode=min the first validation (step 2)
    # stays the best, unless a resumed run forgot it and took its first validation after the kill
    make = lambda **kw: make_cfg(  # noqa: E731
        out="val-kill",
        validation=ValidationConfig(fraction=0.25),
        max_steps=6,
        eval_every=2,
        save_every=2,
        best_metric="prefix_alpha",
        best_mode="min",
        **kw,
    )
    train_killed_after(make(), 3, monkeypatch)
    cfg = make(resume="latest")
    run_mod.train(cfg)
    assert read_best(cfg.output_dir)["step"] == 2


@pytest.mark.parametrize("drafter", options("drafter"))
def test_every_drafter_config_composes_over_its_own_schema(drafter):
    register_configs()
    with initialize_config_module("specblock.configs", version_base=None):
        cfg = compose("train", overrides=["experiment=debug", f"drafter={drafter}"])
    config = OmegaConf.to_object(cfg)
    assert isinstance(config.drafter, train_spec(drafter).config) and config.drafter.name == drafter
    assert config.run_name == f"debug-{drafter}"


def test_a_run_saved_before_each_drafter_had_its_schema_still_loads(tmp_path):
    """Runs saved with the merged drafter config (every drafter's fields) and loss.rank_buckets."""
    register_configs()
    with initialize_config_module("specblock.configs", version_base=None):
        old = OmegaConf.to_container(compose("train", overrides=["experiment=debug"]), resolve=True)
    old["drafter"].update(ttt_length=7)
    del old["drafter"]["num_feature_layers"]
    old["loss"]["rank_buckets"] = [1, 4, 10]
    OmegaConf.save(OmegaConf.create(old), tmp_path / "config.yaml")
    loaded = OmegaConf.to_object(saved_run_config(tmp_path))
    assert isinstance(loaded.drafter, SpecBlockConfig) and loaded.drafter.num_feature_layers == 3
    assert loaded.drafter.draft_vocab_size == 2048 and not hasattr(loaded.loss, "rank_buckets")


def test_cpu_full_math_fine_tunes_the_cpu_full_drafter_on_1600_questions():
    """The math fine-tune (session 21's recipe): GSM8K's train split, 1,600 questions regenerated, from the
    exported cpu_full drafter of the same kind, one SpecBlock block a step as cpu_full trained, 200 steps,
    the valid-prefix loss from step 0."""
    register_configs()
    with initialize_config_module("specblock.configs", version_base=None):
        math, full = (
            OmegaConf.to_container(compose("train", overrides=[f"experiment={e}"]), resolve=True)
            for e in ("cpu_full_math", "cpu_full")
        )
    assert math["data"]["corpus"]["split"] == "train" and math["data"]["corpus"]["limit"] == 1600
    assert math["init_from"] == "checkpoints/cpu_full-specblock/drafter"
    assert math["strategy"]["num_ttt_blocks"] == full["strategy"]["num_ttt_blocks"] == 1
    assert math["trainer"]["max_steps"] == 200
    assert math["loss"]["curriculum"]["start"] == math["loss"]["curriculum"]["end"] == 0


@pytest.mark.parametrize("features", ["online", "offline"])
def test_cut_repeats_cuts_training_and_held_out_rows(make_cfg, features):
    """cut_repeats=1: no row keeps an answer token it already emitted; some rows get shorter."""
    from specblock.data.repeats import cut_at_repeat

    whole = run_mod.build(make_cfg(out=f"whole-{features}", features=features, max_steps=1))
    cfg = make_cfg(out=f"cut-{features}", features=features, max_steps=1)
    cfg.cut_repeats = 1
    cut = run_mod.build(cfg)
    lengths = lambda rows: [len(rows[i]["input_ids"]) for i in range(len(rows))]  # noqa: E731
    assert len(cut.rows) == len(whole.rows)
    assert all(c <= w for c, w in zip(lengths(cut.rows), lengths(whole.rows)))
    assert sum(lengths(cut.rows)) < sum(lengths(whole.rows))
    for rows in (cut.rows, cut.held_out or []):
        for i in range(len(rows)):
            r = rows[i]
            assert cut_at_repeat(r["input_ids"].tolist(), r["loss_mask"].tolist(), 1) == len(r["input_ids"])
            if features == "offline":
                assert len(r["features"]) == len(r["target_argmax"]) == len(r["input_ids"])


def test_cpu_full_6k_cut_is_cpu_full_6k_with_answers_cut():
    base, cut = (compose_train(f"experiment={e}") for e in ("cpu_full_6k", "cpu_full_6k_cut"))
    assert base["cut_repeats"] == 0 and cut["cut_repeats"] == 32
    assert cut["run_name"] == "cpu_full_6k_cut-specblock" and cut["data"] == base["data"]
    for key in ("trainer", "loss", "strategy", "validation", "drafter"):
        a, b = (dict(c[key]) for c in (base, cut))
        for run_key in ("output_dir", "run_name"):
            a.pop(run_key, None), b.pop(run_key, None)
        assert a == b, key


def test_a_wandb_run_without_a_key_goes_offline_before_its_data_stage(
    make_cfg, monkeypatch, caplog, tmp_path
):
    """The mode is settled before `build` (the data stage, a feature capture), not when the trackers start
    after it: a run without a W&B login used to die there, its capture's minutes spent."""
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    seen = {}

    def data_stage(cfg):
        seen["mode"] = os.environ.get("WANDB_MODE")
        raise RuntimeError("stop at the data stage")

    monkeypatch.setattr(run_mod, "build", data_stage)
    with caplog.at_level(logging.WARNING), pytest.raises(RuntimeError, match="data stage"):
        run_mod.train(make_cfg(logger="wandb"))
    assert seen["mode"] == "offline" and "no W&B API key was found" in caplog.text
