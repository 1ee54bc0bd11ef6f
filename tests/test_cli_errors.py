"""A user's mistake in a CLI entry point prints one clear line and exits non-zero, without a stack trace;
HYDRA_FULL_ERROR=1 still shows the trace. Two real subprocesses (Hydra's own error handling is part of
what is tested); the rest in-process."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest

from specblock.data.errors import BadInputError, exit_on_user_error


def run(*args: str, cwd, full_error: bool = False) -> subprocess.CompletedProcess:
    """`python -m ARGS` in `cwd` (Hydra creates its run folder there, not in the repository)."""
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env |= {"HF_HUB_OFFLINE": "1"} | ({"HYDRA_FULL_ERROR": "1"} if full_error else {})
    cmd = [sys.executable, "-m", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=cwd)


@pytest.mark.slow
def test_an_unknown_method_is_one_line_and_hydra_full_error_shows_the_trace(tmp_path):
    done = run("specblock.evaluate", "methods=[bogus]", cwd=tmp_path)
    assert done.returncode == 1 and done.stderr.startswith("error: method 'bogus' is not one of"), done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 2
    full = run("specblock.evaluate", "methods=[bogus]", cwd=tmp_path, full_error=True)
    assert full.returncode != 0 and "Traceback" in full.stderr and "ValueError: method 'bogus'" in full.stderr


@pytest.mark.parametrize(
    "module", ["specblock.data.__main__", "specblock.train.__main__", "specblock.evaluate.__main__"]
)
def test_every_hydra_entry_point_reports_user_errors(module):
    main = importlib.import_module(module).main
    assert getattr(main.__wrapped__, "reports_user_errors", False)  # hydra.main(exit_on_user_error(main))


@pytest.mark.parametrize(
    "err",
    [
        BadInputError("prompts.jsonl", 3, "turns", "missing field"),
        FileNotFoundError("drafters.eagle3: no exported drafter in runs/x"),
        ValueError("drafter.name='nope' is not one of ['eagle3', 'specblock']"),
    ],
)
def test_user_errors_exit_with_one_line(err, capsys, monkeypatch):
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)

    def fails():
        raise err

    with pytest.raises(SystemExit) as exit_:
        exit_on_user_error(fails)()
    assert exit_.value.code == 1 and capsys.readouterr().err.splitlines()[0] == f"error: {err}"
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    with pytest.raises(type(err)):
        exit_on_user_error(fails)()


def test_a_bug_is_not_hidden():
    def bug():
        raise ZeroDivisionError("a bug")

    with pytest.raises(ZeroDivisionError):
        exit_on_user_error(bug)()


def test_a_missing_drafter_folder_is_named(tmp_path, capsys, monkeypatch):
    from specblock.data.target import TINY_TARGET_DIR, TargetConfig
    from specblock.evaluate.config import EvalConfig
    from specblock.evaluate.run import evaluate

    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    cfg = EvalConfig(
        output_dir=str(tmp_path / "eval"), target=TargetConfig(name_or_path=TINY_TARGET_DIR, dtype="float32"),
        drafters={"eagle3": str(tmp_path / "none")}, methods=["chain-token"], datasets=["humaneval"],
    )  # fmt: skip
    with pytest.raises(SystemExit):
        exit_on_user_error(evaluate)(cfg)
    assert f"error: drafters.eagle3: no exported drafter in {tmp_path / 'none'}" in capsys.readouterr().err


def test_specblock_run_reports_a_mistake_and_a_failed_stage(monkeypatch, capsys, tmp_path):
    from specblock.evaluate import cli, pipeline

    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)

    def missing(drafter, extra):
        raise FileNotFoundError(f"no drafter folder for {drafter}")

    monkeypatch.setattr(pipeline, "train_stage", missing)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["run"])
    assert exit_.value.code == 1 and capsys.readouterr().err.startswith(
        "error: no drafter folder for specblock"
    )
    # a training subprocess that fails: its own error was printed; `specblock run` says which stage failed
    monkeypatch.undo()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(pipeline.subprocess, "run", lambda cmd: subprocess.CompletedProcess(cmd, 3))
    with pytest.raises(SystemExit, match="training specblock failed \\(exit status 3\\)"):
        cli.main(["run"])


def test_specblock_run_decodes_t07_in_the_precision_t0_chose(monkeypatch):
    """The sampled stage gets the precision the greedy stage's records name (auto resolved there)."""
    from specblock.evaluate import pipeline

    calls = {}

    def stage(name, overrides):
        calls[name] = list(overrides)
        return [{"dtype": "bfloat16", "method": "autoregressive"}] if name == "greedy" else []

    monkeypatch.setattr(
        pipeline, "train_stage", lambda drafter, extra: f"checkpoints/quick-{drafter}/drafter"
    )
    monkeypatch.setattr(pipeline, "eval_stage", stage)
    pipeline.main([])
    assert "target.dtype=auto" in calls["greedy"]
    assert calls["sampled"][-1] == "target.dtype=bfloat16" and "temperature=0.7" in calls["sampled"]
