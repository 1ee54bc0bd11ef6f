import json
from pathlib import Path

import pytest

from specblock.data import corpora
from specblock.data.corpora import CorpusConfig, default_sharegpt_path, load_conversations
from specblock.data.io import subsample
from specblock.data.errors import BadInputError, RowPolicy

FIXTURES = Path(__file__).parent / "fixtures" / "corpora"
# Enough of the packaged ShareGPT json to hold a few hundred whole rows; the cut makes it a truncated file.
SHAREGPT_HEAD_BYTES = 300_000


def load(source, policy=None, **kw):
    return load_conversations(CorpusConfig(source=str(source), **kw), policy)


def u(text):
    return {"role": "user", "content": text}


def a(text):
    return {"role": "assistant", "content": text}


def write_rows(path, rows):
    """A json list (.json) or json lines (.jsonl) of `rows`."""
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        path.write_text(json.dumps(rows))
    return path


def test_sharegpt_roles_map_and_empty_or_leading_replies_are_dropped():
    rows = load(FIXTURES / "sharegpt.json")
    assert [rid for rid, _ in rows] == ["a_0", "b_0", "b_1", "sharegpt.json:3"]
    assert rows[0][1] == [u("What is 2 + 2?"), a("2 + 2 = 4.")]
    system = {"role": "system", "content": "You answer briefly."}
    assert rows[1][1] == [system, u("Name a colour."), a("Blue."), u("Another?"), a("Green.")]
    # b_1: the leading reply, the blank user turn and the empty final reply go; user/bing are user/assistant.
    assert rows[2][1] == [u("And a third?"), a("Red.")]


def test_messages_jsonl_rows_are_line_numbers_and_only_newlines_split():
    rows = load(FIXTURES / "messages.jsonl")
    assert [rid for rid, _ in rows] == ["m1", "m2", "messages.jsonl:3"]
    assert rows[1][1] == [{"role": "system", "content": "Be terse."}, u("Capital of France?"), a("Paris.")]
    assert "\u2028" in rows[2][1][0]["content"]


def test_alpaca_joins_instruction_and_input():
    rows = load(FIXTURES / "alpaca.json")
    assert [turns for _, turns in rows] == [
        [u("Give a synonym of happy."), a("Glad.")],
        [u("Sum the numbers.\n\n3, 4"), a("7")],
        [u("Reverse the word."), a("olleh")],
    ]


def test_question_answer_rows_are_one_turn_each_and_detected(tmp_path):
    path = write_rows(
        tmp_path / "gsm8k.jsonl",
        [{"question": "2 + 2?", "answer": "4\n#### 4"}, {"question": "3 + 3?", "answer": "6\n#### 6"}],
    )
    assert [turns for _, turns in load(path)] == [
        [u("2 + 2?"), a("4\n#### 4")],
        [u("3 + 3?"), a("6\n#### 6")],
    ]
    write_rows(path, [{"question": "2 + 2?", "answer": "4"}, {"question": "3 + 3?"}])
    with pytest.raises(BadInputError, match=r"gsm8k.jsonl, row 1, field 'answer': missing field"):
        load(path)


def test_a_hub_subset_is_the_dataset_configuration(monkeypatch):
    import datasets

    calls = []

    def fake_load_dataset(source, name=None, split=None):
        calls.append((source, name, split))
        return datasets.Dataset.from_list([{"question": "1 + 1?", "answer": "2"}])

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    rows = load_conversations(CorpusConfig(source="openai/gsm8k", subset="main", split="train"))
    assert calls == [("openai/gsm8k", "main", "train")]
    assert rows == [("openai/gsm8k:train:0", [u("1 + 1?"), a("2")])]


def test_folder_reads_json_and_jsonl_files_in_sorted_order_with_their_own_formats():
    rows = load(FIXTURES / "folder")
    assert [rid for rid, _ in rows] == ["f_0", "b_alpaca.jsonl:0", "b_alpaca.jsonl:1"]
    assert rows[2][1] == [u("Spell cat."), a("c-a-t")]


def test_an_explicit_format_overrides_detection():
    with pytest.raises(BadInputError, match=r"sharegpt.json, row 0, field 'instruction': missing field"):
        load(FIXTURES / "sharegpt.json", format="alpaca")


@pytest.mark.parametrize(
    "row, field, problem",
    [
        (1, "conversations", "missing field"),
        (2, "conversations[0].value", "expected a string, got int"),
        (3, "conversations[1].value", "expected a string, got list"),
        (4, "conversations[1].from", "unknown role 'tool'"),
        (5, "conversations", "empty conversation"),
        (6, "conversations", "no assistant turn"),
        (8, None, "expected a json object, got str"),
        (9, "conversations[0].value", "missing field"),
    ],
)
def test_each_bad_row_names_file_row_and_field(tmp_path, row, field, problem):
    rows = json.loads((FIXTURES / "sharegpt_bad.json").read_text())
    path = write_rows(tmp_path / "one_bad.json", [rows[0], rows[row]])  # the bad row alone after a good one
    with pytest.raises(BadInputError) as err:
        load(path)
    assert (err.value.path, err.value.row, err.value.field) == (str(path), 1, field)
    assert err.value.problem.startswith(problem)


def test_skip_drops_and_counts_bad_rows():
    policy = RowPolicy("skip")
    rows = load(FIXTURES / "sharegpt_bad.json", policy, on_bad_row="skip")
    assert [rid for rid, _ in rows] == ["ok_0", "ok_1"]
    assert policy.total_skipped == 8 and policy.skipped["missing field"] == 2
    assert "skipped 8 bad rows" in policy.summary()


def test_error_mode_stops_at_the_first_bad_row():
    with pytest.raises(BadInputError, match=r"sharegpt_bad.json, row 1, field 'conversations': missing"):
        load(FIXTURES / "sharegpt_bad.json")


def test_truncated_json_keeps_the_whole_rows_before_the_cut():
    with pytest.raises(BadInputError, match=r"truncated.json, row 2: truncated json"):
        load(FIXTURES / "truncated.json")
    policy = RowPolicy("skip")
    rows = load(FIXTURES / "truncated.json", policy, on_bad_row="skip")
    assert [rid for rid, _ in rows] == ["t_0", "t_1"] and policy.total_skipped == 1


def test_a_syntax_error_inside_a_json_list_is_not_called_a_truncation(tmp_path):
    path = tmp_path / "broken.json"
    good = json.dumps({"messages": [u("x"), a("y")]})
    path.write_text(f'[{good},\n{{"messages": oops}},\n{{"messages": []}}\n]')
    policy = RowPolicy("skip")
    rows = load_conversations(CorpusConfig(source=str(path), on_bad_row="skip"), policy)
    assert len(rows) == 1 and list(policy.skipped) == ["invalid json (Expecting value)"]


@pytest.mark.parametrize("suffix", [".json", ".jsonl"])
def test_non_utf8_bytes_name_their_row_and_field(tmp_path, suffix):
    good = {"messages": [u("hi"), a("hello")]}
    path = write_rows(tmp_path / f"latin1{suffix}", [good, {"messages": [u("caf@"), a("ok")]}])
    path.write_bytes(path.read_bytes().replace(b"caf@", b"caf\xe9"))  # Latin-1 'é': not UTF-8
    with pytest.raises(BadInputError) as err:
        load(path)
    assert (err.value.row, err.value.field) == (1, "messages[0].content") and "non-UTF-8" in err.value.problem
    assert len(load(path, on_bad_row="skip")) == 1


def test_invalid_json_line_is_a_bad_row(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": [u("a"), a("b")]}) + "\n{not json\n")
    with pytest.raises(BadInputError, match=r"chat.jsonl, row 1: invalid json"):
        load(path)


@pytest.mark.parametrize(
    "name, text, problem",
    [
        ("empty.json", "  \n", "empty file"),
        ("scalar.json", "42", "expected a json list of rows"),
        ("trailing.json", '[{"messages": []}] extra', "text after the closing"),
        ("unknown.jsonl", '{"text": "plain"}\n', "cannot tell the format"),
        ("corpus.csv", "a,b\n", "unsupported file type"),
    ],
)
def test_whole_file_problems_always_raise(tmp_path, name, text, problem):
    (tmp_path / name).write_text(text)
    with pytest.raises(BadInputError, match=problem):
        load(tmp_path / name, on_bad_row="skip")


def test_nothing_usable_raises_with_the_summary(tmp_path):
    path = write_rows(tmp_path / "none.jsonl", [{"messages": [u("only a question")]}])
    with pytest.raises(BadInputError, match="no usable conversations.*1 x no assistant turn"):
        load(path, on_bad_row="skip")


def test_limit_and_seed_subsample_deterministically(tmp_path):
    rows = [{"id": i, "messages": [u(f"q{i}"), a(f"r{i}")]} for i in range(50)]
    path = write_rows(tmp_path / "many.jsonl", rows)
    ids = {seed: [rid for rid, _ in load(path, limit=10, seed=seed)] for seed in (0, 1)}
    assert ids[0] == [rid for rid, _ in load(path, limit=10, seed=0)] and len(ids[0]) == 10
    assert ids[0] != ids[1] and ids[0] == sorted(ids[0], key=int)  # source order kept
    assert len(load(path, limit=500)) == 50 and subsample([1, 2, 3], None, 0) == [1, 2, 3]


def test_hub_ids_go_through_datasets_and_detect_the_schema(monkeypatch):
    import datasets

    calls = []

    def fake_load_dataset(source, name=None, split=None):
        calls.append((source, split))
        return datasets.Dataset.from_list(
            [
                {"instruction": "Say yes.", "input": None, "output": "Yes."},
                {
                    "instruction": "Count.",
                    "input": "1, 2",
                    "output": None,
                },  # arrow fills a missing key with None
            ]
        )

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    policy = RowPolicy("skip")
    rows = load_conversations(CorpusConfig(source="someone/chats", split="test", on_bad_row="skip"), policy)
    assert calls == [("someone/chats", "test")]
    assert rows == [("someone/chats:test:0", [u("Say yes."), a("Yes.")])]
    assert "someone/chats (split test), row 1, field 'output': missing field" in policy.summary()


def test_a_missing_local_path_fails_fast_without_the_hub():
    with pytest.raises(FileNotFoundError, match="no such corpus"):
        load("./no/such/corpus.jsonl")


def test_config_checks_its_fields():
    for bad in (dict(format="csv"), dict(limit=0), dict(on_bad_row="ignore"), dict(source="")):
        with pytest.raises(ValueError):
            CorpusConfig(**bad)


def test_default_source_is_the_packaged_sharegpt_json(tmp_path, monkeypatch):
    path = default_sharegpt_path()
    assert path.is_file() and path.suffix == ".json"
    # The real file's head (a truncated copy, in tmp_path): real rows, read without parsing all 125 MB.
    head = tmp_path / "head.json"
    with open(path, "rb") as f:
        head.write_bytes(f.read(SHAREGPT_HEAD_BYTES))
    monkeypatch.setattr(corpora, "default_sharegpt_path", lambda: head)
    policy = RowPolicy("skip")
    rows = load_conversations(CorpusConfig(on_bad_row="skip"), policy)
    assert len(rows) > 20 and policy.skipped["truncated json (the file does not end with ']')"] == 1
    roles = {turn["role"] for _, turns in rows for turn in turns}
    assert roles <= {"system", "user", "assistant"}
    assert all(
        turns[-1]["role"] in ("user", "assistant") and any(t["role"] == "assistant" for t in turns)
        for _, turns in rows
    )


def test_interleave_spreads_the_extra_rows_evenly_and_keeps_both_orders():
    out = corpora.interleave(list(range(9)), ["a", "b", "c"])
    assert out == [0, 1, 2, "a", 3, 4, 5, "b", 6, 7, 8, "c"]  # one in four, as in any prefix of 4k rows
    assert corpora.interleave([1, 2], []) == [1, 2]
    uneven = corpora.interleave(list(range(5)), ["x", "y"])
    assert [v for v in uneven if isinstance(v, int)] == list(range(5)) and uneven == [0, 1, 2, "x", 3, 4, "y"]


def test_a_mixture_of_two_corpora_keeps_each_corpus_s_own_draw(tmp_path):
    main = tmp_path / "chat.jsonl"
    main.write_text(
        "".join(
            json.dumps(
                {"messages": [{"role": "user", "content": f"c{i}"}, {"role": "assistant", "content": "ok"}]}
            )
            + "\n"
            for i in range(6)
        )
    )
    qa = tmp_path / "math.jsonl"
    qa.write_text("".join(json.dumps({"question": f"q{i}", "answer": "4"}) + "\n" for i in range(5)))
    chat, math = CorpusConfig(source=str(main)), CorpusConfig(source=str(qa), limit=3, seed=1)
    mixed = corpora.load_mixture(chat, [math])
    drawn = load_conversations(math)
    assert [c for c in mixed if c[0].startswith("math")] == drawn  # the same draw, in its order
    assert [cid for cid, _ in mixed][2::3] == [cid for cid, _ in drawn]  # every third row
    assert corpora.load_mixture(chat, []) == load_conversations(chat)
