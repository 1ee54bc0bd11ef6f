"""Rows of evaluation files: where a row comes from, how its fields are read and checked, and the
prompt it becomes. Shared by the evaluation sets of evalsets.py and question_sets.py."""

from __future__ import annotations

import json
import re
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from .errors import BadInputError, RowPolicy

# A gold answer as GSM8K/MGSM write it: sign, digits or thousands groups (MGSM writes "2,125"), decimals.
_NUMBER = re.compile(r"-?(\d+|\d{1,3}(,\d{3})+)(\.\d+)?")
# Gzip framing for zlib: 16 + the largest window, so that a truncated stream can still be read up to the cut.
_GZIP_WBITS = 16 + zlib.MAX_WBITS


@dataclass(frozen=True)
class EvalPrompt:
    """One prompt: either chat `messages` (the first user turn) or a plain `text` prefix, never both.
    `followups`: further user turns, each asked after the model's own answer to the previous one
    (MT-Bench's second turn); `category`: the set's own category (MT-Bench, Spec-Bench), for reports."""

    dataset: str  # gsm8k | humaneval | mgsm_<lang> | lm1b | alpaca | mt_bench | spec_bench | custom
    id: str  # the row's own id (HumanEval task_id, Alpaca seed id), else "<dataset>/<0-based row>"
    messages: list[dict[str, str]] | None  # [{"role": "user", "content": ...}] for the chat template
    text: str | None  # tokenized as is: LM1B, HumanEval and every set for base models
    reference: str | None = None  # gold number (gsm8k, mgsm), canonical solution, continuation, output
    followups: tuple[str, ...] = ()
    category: str | None = None

    def __post_init__(self):
        if (self.messages is None) == (self.text is None):
            raise ValueError(f"EvalPrompt {self.id}: set exactly one of messages and text")


@dataclass(frozen=True)
class RowAt:
    """Where a row comes from: its dataset label, file (or hub split) and 0-based row."""

    dataset: str
    src: str
    row: int

    def bad(self, field_name: str | None, problem: str) -> BadInputError:
        return BadInputError(self.src, self.row, field_name, problem)

    @property
    def id(self) -> str:
        return f"{self.dataset}/{self.row}"


def file_lines(path: Path, policy: RowPolicy) -> list[bytes]:
    """The file's lines as bytes, gunzipped for .gz. A gzip stream cut short keeps the rows before the cut
    and reports the cut row as bad; a file that is not gzip at all fails as a whole."""
    raw = path.read_bytes()
    if path.suffix != ".gz":
        return raw.split(b"\n")
    unzip = zlib.decompressobj(wbits=_GZIP_WBITS)
    try:
        lines = unzip.decompress(raw).split(b"\n")
    except zlib.error as err:
        raise BadInputError(str(path), None, None, f"not a valid gzip file ({err})") from err
    if not unzip.eof:
        policy.bad(BadInputError(str(path), len(lines) - 1, None, "file ends early (truncated gzip stream)"))
        lines = lines[:-1]
    return lines


def text_rows(path: Path, policy: RowPolicy) -> Iterator[tuple[int, str]]:
    """(0-based line, text) for every non-blank line; a line that is not UTF-8 is a bad row."""
    for row, line in enumerate(file_lines(path, policy)):
        try:
            text = line.decode("utf-8").rstrip("\r")
        except UnicodeDecodeError:
            policy.bad(BadInputError(str(path), row, None, "not valid UTF-8"))
            continue
        if text.strip():
            yield row, text


def read_jsonl(path: Path, policy: RowPolicy) -> Iterator[tuple[int, Any]]:
    """JSON Lines (gsm8k, humaneval .jsonl.gz, alpaca seed tasks): one object a line."""
    for row, text in text_rows(path, policy):
        try:
            yield row, json.loads(text)
        except json.JSONDecodeError:
            policy.bad(BadInputError(str(path), row, None, "not valid JSON (a truncated line?)"))


def read_mgsm_tsv(path: Path, policy: RowPolicy) -> Iterator[tuple[int, Any]]:
    """MGSM tsv: no header, two tab-separated columns (question, answer number), no quoting."""
    for row, text in text_rows(path, policy):
        cols = text.split("\t")
        if len(cols) != 2:
            problem = f"expected 2 tab-separated columns (question, answer), got {len(cols)}"
            policy.bad(BadInputError(str(path), row, None, problem))
            continue
        yield row, {"question": cols[0], "answer_number": cols[1]}


def read_lines(path: Path, policy: RowPolicy) -> Iterator[tuple[int, Any]]:
    """LM1B tokens file: one tokenized sentence a line, as the hub's `text` field."""
    for row, text in text_rows(path, policy):
        yield row, {"text": text}


def str_field(row: dict, key: str, at: RowAt, *, empty_ok: bool = False, label: str | None = None) -> str:
    """row[key] as a string, or the BadInputError naming the field (`label` names nested fields)."""
    name = label or key
    if row.get(key) is None:
        raise at.bad(name, "missing field")
    value = row[key]
    if not isinstance(value, str):
        raise at.bad(name, f"expected a string, got {type(value).__name__}")
    if not empty_ok and not value.strip():
        raise at.bad(name, "empty")
    return value


def number_field(value: str, at: RowAt, key: str) -> str:
    """A gold answer number with thousands commas removed ("2,125" -> "2125")."""
    if not _NUMBER.fullmatch(value.strip()):
        raise at.bad(key, f"expected a number, got {value[:40]!r}")
    return value.strip().replace(",", "")


def one_turn_prompt(
    at: RowAt, content: str, reference: str | None, chat: bool, pid: str | None = None
) -> EvalPrompt:
    """One user turn for chat models, or the content as plain text for base models."""
    messages = [{"role": "user", "content": content}] if chat else None
    return EvalPrompt(at.dataset, pid or at.id, messages, None if chat else content, reference)


@dataclass(frozen=True)
class HubSpec:
    """Where a set lives on the hub: dataset id, config ('{language}' for one per language), split."""

    path: str | None  # None: the set has no default hub copy; a hub id must be configured
    config: str | None
    split: str
    revision: str | None = None  # PARQUET_EXPORT for datasets that still ship a loading script


@dataclass(frozen=True)
class EvalSetSpec:
    """One evaluation set: its local file and reader, its hub split, and how a row becomes a prompt."""

    local_file: str | None  # relative to local_root ('{language}': one file per language); None: config
    read: Callable[[Path, RowPolicy], Iterator[tuple[int, Any]]]  # file -> (0-based row, raw row)
    hub: HubSpec
    build: Callable[[dict, RowAt, bool], EvalPrompt] | None  # raw row -> prompt, or BadInputError
    package_file: tuple[str, str] | None = None  # (package, file in it) used when local_root is unset
    configure: Callable[[Any], Callable[[dict, RowAt, bool], EvalPrompt]] | None = None  # cfg -> build


def read_json_list(path: Path, policy: RowPolicy) -> Iterator[tuple[int, Any]]:
    """A JSON file holding one list of objects (AlpacaEval, ShareGPT style)."""
    try:
        rows = json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise BadInputError(str(path), None, None, f"not valid JSON ({err})") from err
    if not isinstance(rows, list):
        raise BadInputError(
            str(path), None, None, f"expected a JSON list of objects, got {type(rows).__name__}"
        )
    yield from enumerate(rows)


def read_parquet(path: Path, policy: RowPolicy) -> Iterator[tuple[int, Any]]:
    """A Parquet table, one dict per row."""
    import pyarrow.parquet as pq  # here: only this format needs it (installed with `datasets`)

    try:
        table = pq.read_table(path)
    except Exception as err:  # pyarrow raises several types for a file that is not Parquet
        raise BadInputError(str(path), None, None, f"not a readable Parquet file ({err})") from err
    yield from enumerate(table.to_pylist())


def read_any(path: Path, policy: RowPolicy) -> Iterator[tuple[int, Any]]:
    """By suffix: .jsonl / .jsonl.gz (one object a line), .json (a list), .parquet."""
    name = path.name.lower()
    if name.endswith((".jsonl", ".jsonl.gz")):
        return read_jsonl(path, policy)
    if name.endswith(".json"):
        return read_json_list(path, policy)
    if name.endswith(".parquet"):
        return read_parquet(path, policy)
    raise BadInputError(
        str(path), None, None, "unknown format: expected .json, .jsonl, .jsonl.gz or .parquet"
    )
