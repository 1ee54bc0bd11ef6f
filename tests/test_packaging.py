"""The distribution installs `specblock.{data,train,evaluate,configs}` and no top-level
data/train/evaluate."""

import importlib.util
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_stage_packages_import_from_the_specblock_namespace():
    import specblock.configs
    import specblock.data
    import specblock.evaluate
    import specblock.train

    for mod in (specblock.data, specblock.train, specblock.evaluate, specblock.configs):
        assert Path(mod.__file__).resolve().is_relative_to(REPO) or "site-packages" in mod.__file__


@pytest.mark.parametrize("name", ["data", "train", "evaluate"])
def test_no_top_level_stage_module(name):
    # `evaluate` is a Hugging Face library: ours must never shadow it. If something of that name is
    # importable, it must not be one of our folders.
    spec = importlib.util.find_spec(name)
    if spec is not None and spec.origin is not None:
        assert not Path(spec.origin).resolve().is_relative_to(REPO), (
            f"{name} resolves to our folder {spec.origin}"
        )


def test_wheel_layout(tmp_path):
    """`pip install .` installs what this wheel holds: the stage packages under specblock/, configs with
    their YAML, and nothing at top level but specblock/ and the dist-info."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(REPO),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("specblock-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"specblock", next(t for t in tops if t.endswith(".dist-info"))}
    assert "specblock/evaluate/verify/greedy_block.py" in names
    assert any(n.startswith("specblock/configs/") and n.endswith(".yaml") for n in names)
    assert not any(n.startswith("specblock/__init__") for n in names)
