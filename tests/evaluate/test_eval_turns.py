"""The evaluation loop on two-turn prompts (MT-Bench's protocol) and per-category reports, on the tiny
random target and the project's MT-Bench fixture."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specblock.data.target import TINY_TARGET_DIR, TargetConfig, load_target
from specblock.data.embedded import ensure_embedded_target
from specblock.evaluate import run as run_mod
from specblock.evaluate.config import EvalConfig
from specblock.evaluate.decoding.loop import SpeculativeDecoder
from specblock.evaluate.reporting.report import read_jsonl
from specblock.train.export import export_drafter
from specblock.train.drafters import build_drafter
from specblock.train.modeling.eagle3 import Eagle3Config

FIXTURES = Path(__file__).parents[1] / "data" / "fixtures" / "evalsets"


def test_second_turn_follows_each_decoders_own_answer_and_categories_are_reported(tmp_path, monkeypatch):
    ensure_embedded_target(TINY_TARGET_DIR)
    tcfg = TargetConfig(name_or_path=TINY_TARGET_DIR, dtype="float32")
    model, tokenizer = load_target(tcfg)
    torch.manual_seed(0)
    dcfg = Eagle3Config(ttt_length=2, num_feature_layers=3)
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    folder = export_drafter(
        build_drafter("eagle3", dcfg, model.config, emb, head), tmp_path / "d", name="eagle3", drafter_cfg=dcfg,
        target_config=model.config, target_id=TINY_TARGET_DIR, target_revision=None, feature_layers=[2, 4, 5],
    )  # fmt: skip
    generated, asked = [], []
    real_generate, real_turn_ids = SpeculativeDecoder.generate, run_mod.turn_ids

    def generate(self, ids, seed=0, sampler=None):
        g = real_generate(self, ids, seed, sampler)
        generated.append(g.tokens)
        return g

    def turn_ids(prompt, answers, tok):
        asked.append(list(answers))
        return real_turn_ids(prompt, answers, tok)

    monkeypatch.setattr(SpeculativeDecoder, "generate", generate)
    monkeypatch.setattr(run_mod, "turn_ids", turn_ids)
    cfg = EvalConfig(
        output_dir=str(tmp_path / "eval"), target=tcfg, drafters={"eagle3": str(folder)},
        methods=["autoregressive", "chain-token"], datasets=["mt_bench"], local_root=str(FIXTURES),
        mt_bench_turns=2, limit=2, max_new_tokens=4,
    )  # fmt: skip
    rows = run_mod.evaluate(cfg)
    # 2 prompts x 2 methods x 2 turns; turn 2 is asked after the same decoder's decoded turn-1 answer
    assert len(generated) == 8 and asked[0::2] == [[]] * 4
    assert asked[1::2] == [[tokenizer.decode(t, skip_special_tokens=True)] for t in generated[0::2]]
    overall = {r["method"]: r["counts"] for r in rows if r["dataset"] == "overall"}
    assert {c["generations"] for c in overall.values()} == {4}  # every turn counts
    by_category = read_jsonl(tmp_path / "eval" / "results_by_category.jsonl")
    cats = {r["dataset"] for r in by_category if r["dataset"] != "overall"}
    assert len(cats) == 2 and all(c.startswith("mt_bench/") for c in cats)
    report = (tmp_path / "eval" / "results.md").read_text()
    assert "## Per category" in report and all(f"| {c} |" in report for c in cats)


def test_local_root_auto_reads_the_environment_variable(tmp_path, monkeypatch):
    monkeypatch.delenv(run_mod.DATASETS_ENV, raising=False)
    assert run_mod.local_root(EvalConfig()) is None  # auto without the variable: hub and packages
    monkeypatch.setenv(run_mod.DATASETS_ENV, str(tmp_path))
    assert run_mod.local_root(EvalConfig()) == str(tmp_path)
    assert run_mod.local_root(EvalConfig(local_root="elsewhere")) == "elsewhere"
    monkeypatch.setenv(run_mod.DATASETS_ENV, str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="SPECBLOCK_DATASETS"):
        run_mod.local_root(EvalConfig())


def test_a_bad_row_in_an_evaluation_set_is_one_named_error_unless_skipped(tmp_path):
    from specblock.data.errors import BadInputError
    from specblock.data.question_sets import CustomSetConfig

    path = tmp_path / "mine.jsonl"
    path.write_text('{"prompt": "Hello?"}\n{"prompt": 42}\n')
    cfg = EvalConfig(datasets=["custom"], custom=CustomSetConfig(path=str(path)), local_root=None)
    with pytest.raises(BadInputError, match=r"mine.jsonl, row 1, field 'prompt'"):
        run_mod.load_set(cfg, "custom")
    cfg.on_bad_row = "skip"
    es = run_mod.load_set(cfg, "custom")
    assert len(es) == 1 and es.policy.total_skipped == 1
