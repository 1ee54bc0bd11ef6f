"""MT-Bench, Spec-Bench and the user's own prompt files: fixtures in the published formats (FastChat /
Spec-Bench question.jsonl), two-turn prompts, categories, every bad row named, the hub path by id, and
the one-probe hub check."""

import json
from pathlib import Path

import pytest

from specblock.data import hub as hub_mod
from specblock.data.errors import BadInputError
from specblock.data.evalsets import PLAIN_TURN_SEPARATOR, EvalSetConfig, load_eval_set, prompt_ids, turn_ids
from specblock.data.hub import HubUnavailableError
from specblock.data.question_sets import CustomSetConfig

FIXTURES = Path(__file__).parent / "fixtures" / "evalsets"


def load(name, root=FIXTURES, chat=True, **kw):
    return load_eval_set(EvalSetConfig(name=name, local_root=str(root), limit=None, **kw), chat=chat)


def test_mt_bench_first_turn_by_default_both_with_two_turns():
    one, two = load("mt_bench"), load("mt_bench", mt_bench_turns=2)
    assert [p.id for p in one][:2] == ["mt_bench/81", "mt_bench/91"] and len(one) == 5
    first = one.prompts[0]
    assert first.messages == [{"role": "user", "content": first.messages[0]["content"]}]
    assert first.followups == () and first.category == "writing"
    assert two.prompts[0].followups == (
        "Now rewrite the postcard so that every sentence ends with a question.",
    )
    assert [p.category for p in two] == ["writing", "roleplay", "reasoning", "math", "coding"]


def test_spec_bench_keeps_categories_and_single_turn_rows():
    es = load("spec_bench", mt_bench_turns=2)
    assert len(es) == 7 and es.prompts[1].id == "spec_bench/161"
    assert {p.category for p in es} == {
        "writing",
        "translation",
        "summarization",
        "qa",
        "math_reasoning",
        "rag",
    }
    assert len(es.prompts[0].followups) == 1 and all(p.followups == () for p in es.prompts[1:])


def test_custom_jsonl_with_turns_ids_and_categories():
    custom = CustomSetConfig(
        path=str(FIXTURES / "custom" / "prompts.jsonl"),
        prompt_field="question",
        category_field="topic",
        id_field="uid",
    )
    es = load_eval_set(EvalSetConfig(name="custom", custom=custom, limit=None))
    assert [p.id for p in es] == ["custom/a1", "custom/a2", "custom/a3"]
    assert es.prompts[1].followups == ("Which one is easier to reach by train?",)
    assert [p.category for p in es] == ["cooking", "travel", "cooking"]


def test_custom_json_list_as_plain_text_and_parquet(tmp_path):
    plain = CustomSetConfig(
        path=str(FIXTURES / "custom" / "prompts.json"), prompt_field="text", template="plain"
    )
    es = load_eval_set(EvalSetConfig(name="custom", custom=plain, limit=None))
    assert es.prompts[0].messages is None and es.prompts[0].text.startswith("Once upon")
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    pq.write_table(
        pa.table({"prompt": ["Tell me a joke.", "Explain tides."], "kind": ["fun", "science"]}),
        tmp_path / "p.parquet",
    )
    es = load_eval_set(
        EvalSetConfig(
            name="custom", custom=CustomSetConfig(path=str(tmp_path / "p.parquet"), category_field="kind")
        )
    )
    assert [p.messages[0]["content"] for p in es] == ["Tell me a joke.", "Explain tides."]
    assert es.prompts[1].category == "science"


@pytest.mark.parametrize(
    "row, field",
    [
        ({"question_id": 1, "category": "math", "turns": "just a string, not a list"}, None),
        ({"question_id": 1, "category": "math", "turns": []}, "turns"),
        ({"question_id": 1, "category": "math", "turns": ["ok", ""]}, "turns[1]"),
        ({"question_id": 1, "turns": ["ok"]}, "category"),
        ({"category": "math", "turns": ["ok"]}, "question_id"),
    ],
)
def test_bad_question_rows_name_file_row_and_field(tmp_path, row, field):
    (tmp_path / "mt_bench").mkdir()
    good = {"question_id": 0, "category": "writing", "turns": ["Hello?"]}
    (tmp_path / "mt_bench" / "question.jsonl").write_text(json.dumps(good) + "\n" + json.dumps(row) + "\n")
    if field is None:  # a string is one turn: allowed (custom files hold plain strings)
        assert len(load("mt_bench", root=tmp_path)) == 2
        return
    with pytest.raises(BadInputError) as err:
        load("mt_bench", root=tmp_path)
    assert err.value.row == 1 and err.value.field == field and err.value.path.endswith("question.jsonl")


def test_bad_custom_rows_and_files(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text('{"prompt": "fine"}\n{"other": "no prompt here"}\n')
    with pytest.raises(BadInputError, match=r"mine.jsonl, row 1, field 'prompt': missing field"):
        load_eval_set(EvalSetConfig(name="custom", custom=CustomSetConfig(path=str(path))))
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(BadInputError, match="unknown format"):
        load_eval_set(EvalSetConfig(name="custom", custom=CustomSetConfig(path=str(tmp_path / "x.csv"))))
    (tmp_path / "d.json").write_text('{"not": "a list"}')
    with pytest.raises(BadInputError, match="expected a JSON list"):
        load_eval_set(EvalSetConfig(name="custom", custom=CustomSetConfig(path=str(tmp_path / "d.json"))))
    with pytest.raises(ValueError, match="custom.path"):
        EvalSetConfig(name="custom")
    with pytest.raises(ValueError, match="mt_bench_turns"):
        EvalSetConfig(name="mt_bench", mt_bench_turns=3)


def test_second_turn_is_asked_after_the_models_own_answer(tiny_chat):
    _, tok = tiny_chat
    prompt = load("mt_bench", mt_bench_turns=2).prompts[0]
    first, second = turn_ids(prompt, [], tok), turn_ids(prompt, ["the cat sat"], tok)
    assert first == prompt_ids(prompt, tok) and second[: len(first) - 3] == first[: len(first) - 3]
    text = tok.decode(second)
    # user turn, the model's answer, the follow-up, then the assistant turn opened again
    assert text.count("<|im_start|>") == 4 and text.index("the cat sat") < text.rindex("user")
    assert text.rstrip().endswith("assistant")
    with pytest.raises(ValueError, match="2 turns"):
        turn_ids(prompt, ["a", "b"], tok)
    plain = load("mt_bench", chat=False, mt_bench_turns=2).prompts[0]
    expected = plain.text + "one two" + PLAIN_TURN_SEPARATOR + plain.followups[0]
    assert turn_ids(plain, ["one two"], tok) == tok.encode(expected)


def test_question_sets_come_from_a_hub_id_only(monkeypatch):
    datasets = pytest.importorskip("datasets")
    calls = []
    row = {"question_id": 7, "category": "qa", "turns": ["Why is the sky blue?"]}
    monkeypatch.setattr(datasets, "load_dataset", lambda path, **kw: calls.append((path, kw)) or [row] * 2)
    with pytest.raises(FileNotFoundError, match="no default hub copy"):
        load_eval_set(EvalSetConfig(name="spec_bench"))
    es = load_eval_set(EvalSetConfig(name="spec_bench", hub_id="someone/spec-bench"))
    assert calls[0][0] == "someone/spec-bench" and es.sources[0]["hub"] == "someone/spec-bench"
    assert es.prompts[0].category == "qa"


def test_hub_is_probed_once_and_every_set_fails_at_once(monkeypatch):
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    probes = []
    monkeypatch.setattr(hub_mod, "_probe", lambda endpoint, timeout: probes.append(timeout) or False)
    hub_mod.hub_reachable.cache_clear()
    try:
        for name in ("gsm8k", "alpaca", "lm1b"):
            with pytest.raises(HubUnavailableError, match="not reachable"):
                load_eval_set(EvalSetConfig(name=name))
    finally:
        hub_mod.hub_reachable.cache_clear()
    assert probes == [hub_mod.HUB_PROBE_TIMEOUT_S]


def test_offline_mode_skips_the_probe(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub_mod, "_probe", lambda *a: pytest.fail("probed in offline mode"))
    hub_mod.hub_reachable.cache_clear()
    try:
        assert hub_mod.hub_reachable()
    finally:
        hub_mod.hub_reachable.cache_clear()
