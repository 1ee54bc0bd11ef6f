"""scripts/mix_corpus.py: the math rows spread evenly through the ShareGPT rows, drawn by seed, and bad
rows named by file and row."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from specblock.data.errors import BadInputError

_spec = importlib.util.spec_from_file_location(
    "mix_corpus", Path(__file__).resolve().parents[1] / "scripts" / "mix_corpus.py"
)
mix = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mix)


def test_gsm8k_rows_are_seeded_and_bad_rows_named(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text(
        "".join(json.dumps({"question": f"q{i}", "answer": f"a{i} #### {i}"}) + "\n" for i in range(6))
    )
    first, again = mix.gsm8k_rows(path, 3, seed=0), mix.gsm8k_rows(path, 3, seed=0)
    assert first == again and [r["id"] for r in first] == ["gsm8k-train-0", "gsm8k-train-1", "gsm8k-train-2"]
    assert first[0]["messages"][0]["role"] == "user" and first[0]["messages"][0]["content"].startswith("q")
    assert mix.gsm8k_rows(path, 3, seed=1) != first
    with pytest.raises(SystemExit, match="holds 6"):
        mix.gsm8k_rows(path, 7, seed=0)
    path.write_text(json.dumps({"question": "q"}) + "\n")
    with pytest.raises(BadInputError, match=r"train.jsonl, row 0, field 'answer': missing field"):
        mix.gsm8k_rows(path, 1, seed=0)
