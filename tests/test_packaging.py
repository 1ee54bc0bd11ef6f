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


def our_folder(name: str) -> str | None:
    """Where in this repository `import name` would load from (a module, a package or a namespace
    folder), or None when it resolves elsewhere or nowhere."""
    spec = importlib.util.find_spec(name)
    if spec is None:
        return None
    places = [spec.origin] if spec.origin else list(spec.submodule_search_locations or [])
    return next((p for p in places if Path(p).resolve().is_relative_to(REPO)), None)


@pytest.mark.parametrize("name", ["data", "train", "evaluate"])
def test_no_top_level_stage_module(name):
    # `evaluate` is a Hugging Face library: ours must never shadow it, nor anything else named so.
    assert our_folder(name) is None, f"`import {name}` resolves to our folder {our_folder(name)}"


@pytest.mark.parametrize("name", ["data", "train", "evaluate"])
def test_the_shadowing_check_finds_our_folder_on_sys_path(name):
    """The check above can fail: with the repository root on sys.path (what `python -m pytest` does) it
    names our folder. In a fresh interpreter, where nothing of that name is imported yet."""
    code = (
        f"import sys; sys.path.insert(0, {str(REPO)!r}); sys.path.insert(0, {str(Path(__file__).parent)!r}); "
        f"import test_packaging as t; print(t.our_folder({name!r}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert Path(out.stdout.strip()).resolve() == REPO / name / "__init__.py"


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
    # every sub-package of the stage folders ships (pyproject.toml lists them one by one)
    packages = [
        p.parent.relative_to(REPO)
        for s in ("data", "train", "evaluate")
        for p in (REPO / s).rglob("__init__.py")
    ]
    assert not [p for p in packages if f"specblock/{p.as_posix()}/__init__.py" not in names]
    assert any(n.startswith("specblock/configs/") and n.endswith(".yaml") for n in names)
    assert not any(n.startswith("specblock/__init__") for n in names)
