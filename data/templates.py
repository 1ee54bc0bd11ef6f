"""A conversation through the target's chat template: token ids plus an assistant-only loss mask, and the
hashes of the template and the tokenizer that manifests record.

`render_with_mask(tokenizer, turns, max_length)` gives the ids that `tokenizer.apply_chat_template(turns)`
gives, and a 0/1 mask that is 1 exactly on the tokens of assistant turns: their content and the end-of-turn
token the template writes after it (what the target generates, so what a drafter learns to predict), never
an assistant role header, a system or user turn, or a system prompt the template injects by itself (SmolLM2
does when the conversation has none). mask[t] == 1 makes token t a label: a next-token loss predicts it from
position t - 1 (the caller shifts).

Both methods find assistant text as character spans of the rendered string, and a token is masked when its
character offsets overlap a span (as transformers does for `return_assistant_tokens_mask`):
- "generation": the template wraps assistant text in {% generation %} ... {% endgeneration %}, and
  transformers reports those spans. Exact by construction, when the template carries the markers.
- "prefix", for any other template: for assistant turn i, the render of turns[:i] with the generation prompt
  ends where the reply starts, and the render of turns[:i + 1] ends after its end-of-turn token plus any
  separator; trailing whitespace is cut from the span, since generation stops at the end-of-turn token and
  the separator after it is never generated. Assumption, checked on every call: the template is
  prefix-stable, i.e. both renders are prefixes of the full render and the span holds the turn's content.
  ChatML (SmolLM2, Qwen2.5) and Llama-3 templates are. A template that renders a turn differently once more
  turns follow (Qwen3 adds an empty think block to the last reply only) is not, and raises
  TemplateMaskError: give such a template {% generation %} markers. A conversation must not open with an
  assistant turn (templates cannot render the empty prefix); load_conversations drops such turns.
"auto" takes "generation" when the template has the markers, else "prefix".
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Turn = dict[str, str]
Span = tuple[int, int]  # [start, end) character offsets into the rendered conversation
MASK_METHODS = ("auto", "generation", "prefix")
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


class TemplateMaskError(ValueError):
    """The chat template breaks an assumption of the masking method (see the module docstring)."""


def render_with_mask(
    tokenizer: PreTrainedTokenizerBase, turns: list[Turn], max_length: int, method: str = "auto"
) -> tuple[list[int], list[int]]:
    """Token ids [T] of the templated conversation and its assistant loss mask [T] (0/1), both cut to
    T <= max_length tokens (a cut keeps the start: the prompt a reply depends on)."""
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")
    if not turns:
        raise ValueError("cannot render an empty conversation")
    ids, mask = MASKERS[mask_method(tokenizer, method)](tokenizer, turns)
    return ids[:max_length], mask[:max_length]


def mask_method(tokenizer: PreTrainedTokenizerBase, method: str = "auto") -> str:
    """The masking method that `method` resolves to for this tokenizer's template."""
    if method not in MASK_METHODS:
        raise ValueError(f"method must be one of {MASK_METHODS}, got {method!r}")
    if method != "auto":
        return method
    template = tokenizer.chat_template
    return "generation" if isinstance(template, str) and _GENERATION_TAG.search(template) else "prefix"


def _generation_mask(tokenizer: PreTrainedTokenizerBase, turns: list[Turn]) -> tuple[list[int], list[int]]:
    """ids [T] and mask [T] from the template's own {% generation %} markers."""
    out = tokenizer.apply_chat_template(
        turns, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
    if not any(mask):
        # A template with the markers always yields some assistant text (rows hold an assistant turn), so
        # an empty mask means the markers are not where the assistant content is rendered.
        raise TemplateMaskError("the template's {% generation %} blocks cover no token of this conversation")
    return ids, mask


def _prefix_mask(tokenizer: PreTrainedTokenizerBase, turns: list[Turn]) -> tuple[list[int], list[int]]:
    """ids [T] and mask [T] from assistant spans found by rendering prefixes of the conversation."""
    text, spans = assistant_char_spans(tokenizer, turns)
    return _tokens_in_spans(tokenizer, text, spans)


def assistant_char_spans(tokenizer: PreTrainedTokenizerBase, turns: list[Turn]) -> tuple[str, list[Span]]:
    """The rendered conversation and the [start, end) character span of each assistant turn in it, found
    by rendering prefixes (the "prefix" method); raises TemplateMaskError if the template is not
    prefix-stable."""
    full = _render(tokenizer, turns)
    spans = []
    for i, turn in enumerate(turns):
        if turn["role"] != "assistant":
            continue
        if i == 0:
            raise TemplateMaskError("turn 0 is an assistant turn: the prefix before it cannot be rendered")
        start = len(_prefix_of(full, _render(tokenizer, turns[:i], generation_prompt=True), i))
        end = len(_prefix_of(full, _render(tokenizer, turns[: i + 1]), i))
        end = start + len(full[start:end].rstrip())
        if turn["content"].strip() not in full[start:end]:
            raise TemplateMaskError(
                f"turn {i}: the assistant span {full[start:end]!r} does not hold the "
                "turn's content: the template is not prefix-stable; add {% generation %} "
                "markers"
            )
        spans.append((start, end))
    return full, spans


def _render(tokenizer: PreTrainedTokenizerBase, turns: list[Turn], generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=generation_prompt)


def _prefix_of(full: str, prefix: str, turn: int) -> str:
    """`prefix`, checked to be one of `full`."""
    if not full.startswith(prefix):
        raise TemplateMaskError(
            f"turn {turn}: rendering the conversation up to this turn is not a prefix of rendering all of it "
            "(the template renders a turn differently once more turns follow); add {% generation %} markers "
            "around the assistant text of the template, or use a prefix-stable template"
        )
    return prefix


def _tokens_in_spans(
    tokenizer: PreTrainedTokenizerBase, text: str, spans: list[Span]
) -> tuple[list[int], list[int]]:
    """Tokenizes `text` as apply_chat_template does (no extra special tokens) -> ids [T], and mask [T] with
    1 on every token whose character offsets overlap a span. `spans` are sorted and disjoint."""
    if not tokenizer.is_fast:
        raise TemplateMaskError("the 'prefix' method needs a fast tokenizer (for character offsets)")
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, mask, k = list(enc["input_ids"]), [0] * len(enc["input_ids"]), 0
    for t, (start, end) in enumerate(enc["offset_mapping"]):
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        mask[t] = int(end > spans[k][0])
    return ids, mask


MASKERS: dict[str, Callable[[PreTrainedTokenizerBase, list[Turn]], tuple[list[int], list[int]]]] = {
    "generation": _generation_mask,
    "prefix": _prefix_mask,
}
