"""The benchmarks speculative-decoding papers report (MT-Bench, Spec-Bench) and a set of the user's own
prompts.

  mt_bench     FastChat's `fastchat/llm_judge/data/mt_bench/question.jsonl`: one object a line,
               {question_id, category, turns: [first, second], reference?}. The first turn by default;
               with mt_bench_turns=2 the second turn is asked after the model's own first answer.
  spec_bench   Spec-Bench's `data/spec_bench/question.jsonl`: the same fields (its MT-Bench rows have two
               turns, the others one); reports break results down by `category`.
  custom       any local .json (a list of objects), .jsonl(.gz) or .parquet file, or a hub dataset:
               the prompt is the field `prompt_field` (a string, or a list of strings = turns), asked
               through the chat template (template=chat) or as plain text (template=plain).

Local copies live at <local_root>/mt_bench/question.jsonl and <local_root>/spec_bench/question.jsonl;
neither set has an official hub copy, so the hub path needs a dataset id (`hub_id`) with the same fields.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

from .evalrows import (
    EvalPrompt,
    EvalSetSpec,
    HubSpec,
    RowAt,
    one_turn_prompt,
    read_any,
    read_jsonl,
    str_field,
)

# MT-Bench questions have exactly two turns; a config asking for more is a mistake.
MAX_QUESTION_TURNS = 2
TEMPLATES = ("chat", "plain")


@dataclass
class CustomSetConfig:
    """A set of the user's own prompts (name `custom`): from a local file, else from a hub dataset."""

    path: str | None = None  # .json (a list of objects) | .jsonl | .jsonl.gz | .parquet
    hub_id: str | None = None  # used when path is None
    split: str = "train"  # of the hub dataset
    prompt_field: str = "prompt"  # a string (one user turn) or a list of strings (turns, in order)
    category_field: str | None = None  # reports break results down by it when set
    id_field: str | None = None  # None: "<custom>/<0-based row>"
    template: str = "chat"  # chat: user turns through the chat template | plain: the text as is

    def __post_init__(self):
        if self.template not in TEMPLATES:
            raise ValueError(f"custom.template={self.template!r} is not one of {TEMPLATES}")


def _turns(row: dict, key: str, at: RowAt) -> list[str]:
    """row[key] as a non-empty list of non-empty strings (a plain string is one turn)."""
    value = row.get(key)
    if isinstance(value, str):
        return [str_field(row, key, at)]
    if not isinstance(value, list) or not value:
        got = "missing field" if value is None else f"expected a non-empty list of strings, got {value!r:.40}"
        raise at.bad(key, got)
    for i, turn in enumerate(value):
        if not isinstance(turn, str) or not turn.strip():
            raise at.bad(f"{key}[{i}]", f"expected a non-empty string, got {turn!r:.40}")
    return value


def _question_id(row: dict, key: str, at: RowAt) -> str:
    value = row.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, str)) or not str(value).strip():
        raise at.bad(
            key, "missing field" if value is None else f"expected an id (int or string), got {value!r:.40}"
        )
    return str(value)


def question_builder(turns: int) -> Callable[[dict, RowAt, bool], EvalPrompt]:
    """FastChat question.jsonl rows -> the first turn, plus up to turns-1 follow-ups."""

    def build(row: dict, at: RowAt, chat: bool) -> EvalPrompt:
        qid, category = _question_id(row, "question_id", at), str_field(row, "category", at)
        asked = _turns(row, "turns", at)[:turns]
        prompt = one_turn_prompt(at, asked[0], None, chat, f"{at.dataset}/{qid}")
        return replace(prompt, followups=tuple(asked[1:]), category=category)

    return build


def custom_builder(cfg: CustomSetConfig) -> Callable[[dict, RowAt, bool], EvalPrompt]:
    """The user's rows -> every turn of `prompt_field`, with the configured id and category."""

    def build(row: dict, at: RowAt, chat: bool) -> EvalPrompt:
        asked = _turns(row, cfg.prompt_field, at)
        pid = f"{at.dataset}/{_question_id(row, cfg.id_field, at)}" if cfg.id_field else None
        category = str_field(row, cfg.category_field, at) if cfg.category_field else None
        prompt = one_turn_prompt(at, asked[0], None, chat and cfg.template == "chat", pid)
        return replace(prompt, followups=tuple(asked[1:]), category=category)

    return build


def _question_spec(folder: str) -> EvalSetSpec:
    return EvalSetSpec(
        local_file=f"{folder}/question.jsonl",
        read=read_jsonl,
        hub=HubSpec(None, None, "train"),
        build=None,
        configure=lambda cfg: question_builder(cfg.mt_bench_turns),
    )


def _custom_configure(cfg: Any) -> Callable[[dict, RowAt, bool], EvalPrompt]:
    return custom_builder(cfg.custom)


QUESTION_SETS: dict[str, EvalSetSpec] = {
    "mt_bench": _question_spec("mt_bench"),
    "spec_bench": _question_spec("spec_bench"),
    "custom": EvalSetSpec(None, read_any, HubSpec(None, None, "train"), None, configure=_custom_configure),
}
