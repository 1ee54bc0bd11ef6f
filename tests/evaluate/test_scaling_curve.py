"""scripts/scaling_curve.py: which checkpoints a curve evaluates now and which cached evaluations it rereads;
scripts/curve_projection.py: the fitted gain per doubling of the tokens and where it reaches a target."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "scaling_curve", Path(__file__).resolve().parents[2] / "scripts" / "scaling_curve.py"
)
curve = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(curve)


def fake_run(root: Path, steps: list[int], evaluated: dict[int, list[str]]) -> Path:
    """A run folder with complete checkpoints at `steps`; `evaluated[step]` = the datasets its cached curve
    evaluation holds (as the evaluation app records them: MGSM per language, plus `overall`)."""
    for step in steps:
        folder = root / f"step_{step:06d}"
        folder.mkdir(parents=True)
        (folder / "meta.json").write_text(json.dumps({"step": step, "tokens": step * 10, "train_ms": step}))
    for step, sets in evaluated.items():
        ev = root / "curve" / f"step_{step:06d}" / "eval"
        ev.mkdir(parents=True)
        lines = [json.dumps({"dataset": d, "method": "x:tree", "metrics": {}}) for d in [*sets, "overall"]]
        (ev / "results.jsonl").write_text("\n".join(lines) + "\n")
        (ev / "curve_settings.json").write_text(json.dumps(curve.wanted(ARGS)))
    return root


ARGS = argparse.Namespace(datasets=list(curve.DATASETS), limit=3, max_new_tokens=64, steps=None)


def test_cached_evaluations_are_reread_and_incomplete_ones_redone(tmp_path):
    every = ["gsm8k", "humaneval", "mgsm_en", "lm1b", "alpaca"]  # MGSM as recorded: per language
    run = fake_run(tmp_path, [100, 200, 300], {100: every, 200: ["humaneval"]})
    results = lambda step: run / "curve" / f"step_{step:06d}" / "eval" / "results.jsonl"  # noqa: E731
    assert curve.cached(results(100), ARGS)
    assert not curve.cached(results(200), ARGS)  # HumanEval only (a run without the evaluation files)
    assert not curve.cached(results(300), ARGS)
    other = argparse.Namespace(**{**vars(ARGS), "limit": 4})
    assert not curve.cached(results(100), other)  # made with other settings


def test_steps_choose_what_is_evaluated_now_and_keep_cached_points(tmp_path):
    every = ["gsm8k", "humaneval", "mgsm_en", "lm1b", "alpaca"]
    run = fake_run(tmp_path, [100, 200, 300, 400], {100: every})
    names = lambda args: [p.name for p in curve.chosen(run, args)]  # noqa: E731
    assert names(ARGS) == ["step_000100", "step_000200", "step_000300", "step_000400"]
    assert names(argparse.Namespace(**{**vars(ARGS), "steps": [400]})) == ["step_000100", "step_000400"]


def test_a_cached_point_stays_on_the_curve_after_its_checkpoint_is_pruned(tmp_path):
    every = ["gsm8k", "humaneval", "mgsm_en", "lm1b", "alpaca"]
    run = fake_run(tmp_path, [100, 200, 300], {100: every, 200: every})
    for step in (100, 200):  # what point() leaves beside the evaluation
        meta = json.loads((run / f"step_{step:06d}" / "meta.json").read_text())
        (run / "curve" / f"step_{step:06d}" / "meta.json").write_text(json.dumps(meta))
    for f in (run / "step_000100").iterdir():  # keep_last pruned step 100
        f.unlink()
    (run / "step_000100").rmdir()
    names = lambda args: [p.name for p in curve.chosen(run, args)]  # noqa: E731
    assert names(ARGS) == ["step_000100", "step_000200", "step_000300"]
    assert curve.read_meta(curve.chosen(run, ARGS)[0])["step"] == 100
    assert names(argparse.Namespace(**{**vars(ARGS), "steps": [300]})) == [
        "step_000100",
        "step_000200",
        "step_000300",
    ]


def test_an_earlier_curve_keeps_the_points_of_runs_not_evaluated_now(tmp_path):
    old = [
        {"run": "gone-specblock", "step": 40, "tokens": 1, "minutes": 1.0},
        {"run": "gone-eagle3", "step": 100, "tokens": 2, "minutes": 2.0},
        {"run": "new-run", "step": 40, "tokens": 3, "minutes": 3.0},  # evaluated again now: dropped
    ]
    listed = tmp_path / "list.json"  # the format of curves made before the settings were recorded
    listed.write_text(json.dumps(old))
    kept = curve.earlier_points(listed, [tmp_path / "new-run"], ARGS)
    assert [p["run"] for p in kept] == ["gone-specblock", "gone-eagle3"]
    with_settings = tmp_path / "doc.json"
    with_settings.write_text(json.dumps({"settings": curve.wanted(ARGS), "points": old}))
    assert curve.earlier_points(with_settings, [], ARGS) == old


def test_an_earlier_curve_made_with_other_settings_is_refused_naming_them(tmp_path):
    doc = tmp_path / "doc.json"
    doc.write_text(json.dumps({"settings": {**curve.wanted(ARGS), "limit": 4}, "points": []}))
    try:
        curve.earlier_points(doc, [], ARGS)
    except SystemExit as exc:
        assert "limit" in str(exc) and str(doc) in str(exc) and "max_new_tokens" not in str(exc)
    else:
        raise AssertionError("a curve made with other settings was accepted")


def test_a_continued_run_is_drawn_at_its_cumulative_compute(tmp_path):
    first = fake_run(tmp_path / "first", [100, 200], {})
    (first / "config.yaml").write_text("run_name: first\n")
    (first / "best.json").write_text(json.dumps({"folder": "step_000100", "step": 100}))
    second = fake_run(tmp_path / "second", [50], {})
    (second / "config.yaml").write_text(f"init_from: {first / 'drafter'}\n")
    third = fake_run(tmp_path / "third", [10], {})
    (third / "config.yaml").write_text(f"init_from: {second / 'drafter'}\n")
    assert curve.prior_compute(first) == (0, 0.0)
    # the best step (100: 1,000 tokens, 100 ms), not the last one
    assert curve.prior_compute(second) == (1000, 100 / 60_000)
    # a chain: second has no best.json, so its last step (50) counts, plus first's
    assert curve.prior_compute(third) == (1500, 150 / 60_000)
    for f in (second / "step_000050").iterdir():  # pruned, but its curve copy stays
        f.unlink()
    (second / "step_000050").rmdir()
    (second / "curve" / "step_000050").mkdir(parents=True)
    (second / "curve" / "step_000050" / "meta.json").write_text(json.dumps({"step": 50, "tokens": 500}))
    (second / "best.json").write_text(json.dumps({"folder": "step_000050", "step": 50}))
    assert curve.prior_compute(third)[0] == 1500


def test_a_continued_run_whose_source_is_unknown_is_refused(tmp_path):
    run = fake_run(tmp_path / "run", [10], {})
    (run / "config.yaml").write_text(f"init_from: {tmp_path / 'elsewhere' / 'drafter'}\n")
    try:
        curve.prior_compute(run)
    except SystemExit as exc:
        assert "init_from" in str(exc) and "elsewhere" in str(exc)
    else:
        raise AssertionError("a run continuing an unknown drafter was drawn from zero")


def test_a_point_missing_sets_stops_the_curve_naming_them(tmp_path, monkeypatch):
    run = fake_run(tmp_path / "run", [10], {})
    (run / "curve" / "step_000010" / "drafter").mkdir(parents=True)
    (run / "curve" / "step_000010" / "drafter" / "config.json").write_text("{}")
    from specblock.data.target import TargetConfig

    monkeypatch.setattr(curve, "run_config", lambda run: ("specblock", TargetConfig()))

    def offline_evaluate(cfg):  # as the app would with on_unavailable=skip: the sets it cannot load skipped
        assert cfg.on_unavailable == "error"  # the app itself stops first
        out = Path(cfg.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        rows = [{"dataset": d, "method": "specblock:tree", "metrics": {}} for d in ("humaneval", "overall")]
        (out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    monkeypatch.setattr(curve, "evaluate", offline_evaluate)
    try:
        curve.point(run, run / "step_000010", argparse.Namespace(**{**vars(ARGS), "local_root": "auto"}))
    except SystemExit as exc:
        assert "gsm8k, mgsm, lm1b, alpaca" in str(exc) and "SPECBLOCK_DATASETS" in str(exc)
    else:
        raise AssertionError("a curve point without most of its sets was drawn")


_proj_spec = importlib.util.spec_from_file_location(
    "curve_projection", Path(__file__).resolve().parents[2] / "scripts" / "curve_projection.py"
)
projection = importlib.util.module_from_spec(_proj_spec)
_proj_spec.loader.exec_module(projection)


def test_projection_fits_gain_per_doubling_and_where_the_line_reaches_the_target():
    # overall = 1.0 + 0.1 * log2(tokens / 1000) exactly; GSM8K flat: never reaches its target
    points = [
        {"run": "r", "tokens": t, "minutes": t / 1000, "tree_overall": 1.0 + 0.1 * math.log2(t / 1000),
         "tree_gsm8k": 1.5}
        for t in (1000, 4000, 16000)
    ] + [{"run": "short", "tokens": 10, "minutes": 1, "tree_overall": 1.0, "tree_gsm8k": 1.0}]  # fmt: skip
    rows = projection.project(points, {"gsm8k": 2.5, "overall": 1.5})
    assert [r["run"] for r in rows] == ["r"]  # one point is not a curve
    overall = rows[0]["overall"]
    assert math.isclose(overall["gain_per_doubling"], 0.1)
    assert math.isclose(overall["last_gain_per_doubling"], 0.1)
    assert math.isclose(overall["tokens_needed"], 1000 * 2**5)  # 1.0 + 0.1 * 5 = 1.5
    assert math.isclose(overall["times_last_tokens"], 2.0)
    assert math.isclose(overall["minutes_needed"], 32.0)  # the run's 1000 tokens a minute
    assert rows[0]["gsm8k"]["tokens_needed"] is None
    text = projection.table(rows)
    assert "| r | 3 (1,000-16,000) | overall 1.50 | 1.40 | +0.100, +0.100 | 32,000 tokens | 2 | 1 |" in text
    assert "never (not rising)" in text


def test_projection_refuses_a_fit_without_two_token_counts():
    with pytest.raises(ValueError, match="two or more distinct token counts"):
        projection.log_fit([5, 5], [1.0, 2.0])
