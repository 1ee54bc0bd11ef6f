import json

import pytest

from specblock.data import regenerate as regen
from specblock.data.regenerate import RegenerateConfig, read_done, regenerate

CONVS = [
    (
        f"c{i}",
        [
            {"role": "user", "content": "what is the cat"},
            {"role": "assistant", "content": "one two"},
            {"role": "user", "content": "why"},
            {"role": "assistant", "content": "three"},
        ],
    )
    for i in range(7)
]


def cfg(**kw):
    return RegenerateConfig(max_new_tokens=5, batch_size=3, **kw)


def test_answers_are_rewritten_by_the_model_round_by_round(tiny_chat, tmp_path):
    model, tok = tiny_chat
    out = regenerate(model, tok, CONVS[:2], tmp_path / "r.jsonl", cfg(turns=2, temperature=0.0))
    for cid, turns in out:
        assert [t["role"] for t in turns] == ["user", "assistant", "user", "assistant"]
        assert turns[0]["content"] == "what is the cat" and turns[1]["content"] != "one two"
    one = regenerate(model, tok, CONVS[:2], tmp_path / "one.jsonl", cfg(turns=1))
    assert [len(t) for _, t in one] == [2, 2] and one[0][1][1] == out[0][1][1]  # greedy: same first answer


def test_a_killed_run_resumes_without_duplicates_or_losses(tiny_chat, tmp_path, monkeypatch):
    model, tok = tiny_chat
    reference = regenerate(model, tok, CONVS, tmp_path / "ref.jsonl", cfg(temperature=0.8))

    calls = {"n": 0}
    real = regen.generate_batch

    def dying(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:  # killed while the second batch runs
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(regen, "generate_batch", dying)
    path = tmp_path / "run.jsonl"
    with pytest.raises(KeyboardInterrupt):
        regenerate(model, tok, CONVS, path, cfg(temperature=0.8))
    monkeypatch.setattr(regen, "generate_batch", real)
    assert len(read_done(path)) == 3
    with open(path, "a") as f:
        f.write('{"id": "c3", "turns": [')  # a write cut by the kill
    resumed = regenerate(model, tok, CONVS, path, cfg(temperature=0.8))
    assert resumed == reference  # sampling is seeded per batch: the same rows as an uninterrupted run
    ids = [json.loads(line)["id"] for line in path.read_text().splitlines()]
    assert sorted(ids) == sorted(c for c, _ in CONVS) and len(ids) == len(set(ids))


def test_config_is_validated():
    with pytest.raises(ValueError):
        RegenerateConfig(turns=0)
    with pytest.raises(ValueError):
        RegenerateConfig(top_p=0.0)
