"""A user's mistake in a CLI entry point prints one clear line and exits non-zero, without a stack trace;
HYDRA_FULL_ERROR=1 still shows the trace."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from specblock.data.target import TINY_TARGET_DIR, ensure_embedded_target


def run(*args: str, full_error: bool = False) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env |= {"HF_HUB_OFFLINE": "1"} | ({"HYDRA_FULL_ERROR": "1"} if full_error else {})
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.parametrize(
    "args, message",
    [
        (("specblock.evaluate", "methods=[bogus]"), "error: method 'bogus' is not one of"),
        (("specblock.train", "drafter.name=nope"), "error: drafter.name='nope' is not one of"),
        (("specblock.data", "data.max_length=2"), "error: prepare needs max_length >= 8"),
    ],
)
def test_a_bad_config_value_is_one_line_without_a_trace(args, message):
    done = run(*args)
    assert done.returncode != 0 and done.stderr.startswith(message), done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 2


def test_hydra_full_error_still_shows_the_trace():
    done = run("specblock.evaluate", "methods=[bogus]", full_error=True)
    assert done.returncode != 0 and "Traceback" in done.stderr and "ValueError: method 'bogus'" in done.stderr


def test_a_missing_drafter_folder_is_named(tmp_path):
    ensure_embedded_target(TINY_TARGET_DIR)
    done = run(
        "specblock.evaluate", f"target.name_or_path={TINY_TARGET_DIR}", f"drafters.eagle3={tmp_path / 'none'}",
        "~drafters.specblock", "methods=[chain-token]", "datasets=[humaneval]", "local_root=null",
        f"output_dir={tmp_path / 'eval'}",
    )  # fmt: skip
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert f"error: drafters.eagle3: no exported drafter in {tmp_path / 'none'}" in done.stderr


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
