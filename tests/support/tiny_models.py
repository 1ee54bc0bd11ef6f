"""Tiny random targets and tokenizers shared by the tests (importable as `tiny_models`: pyproject puts
tests/support on sys.path for pytest; scripts launched by tests add it themselves).

Every builder seeds torch itself, so a given call always makes the same weights.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # transformers is imported by the builders: conftest imports this module
    from transformers import Gemma2ForCausalLM, LlamaConfig, LlamaForCausalLM

# A ChatML-style template (SmolLM2 uses ChatML), written here so tests need no download.
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WORDS = (
    "the a cat dog sat on mat and ran fast slow red blue one two three four five is was what why how".split()
)
# Gemma 2's final_logit_softcapping; below the |logits| of a tiny random model (~0.3), so the cap bites.
TINY_SOFTCAP = 0.1


def llama_config(
    vocab_size: int, hidden: int = 32, layers: int = 4, heads: int = 4, kv_heads: int = 2, **overrides
) -> LlamaConfig:
    """A Llama config of the given widths (intermediate 2 x hidden, 128 positions) plus `overrides`."""
    from transformers import LlamaConfig

    args = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=128,
    )
    return LlamaConfig(**(args | overrides))


def tiny_llama(vocab_size: int, seed: int = 0, **config) -> LlamaForCausalLM:
    """A random Llama in eval mode (`config`: `llama_config`'s arguments), weights seeded by `seed`."""
    from transformers import LlamaForCausalLM

    cfg = llama_config(vocab_size, **config)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).eval()


def tiny_softcapped(vocab_size: int, seed: int = 0, softcap: float = TINY_SOFTCAP) -> Gemma2ForCausalLM:
    """A random Gemma 2 (its head soft-caps the logits: tanh(z / cap) * cap) in eval mode, float32."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    cfg = Gemma2Config(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=128,
        final_logit_softcapping=softcap,
        attn_implementation="eager",
    )
    torch.manual_seed(seed)
    return Gemma2ForCausalLM(cfg).eval()


def chat_tokenizer(chat_template: str = CHATML):
    """A word-level tokenizer with ChatML specials; ids: specials first, then WORDS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<|im_start|>", "<|im_end|>", "<pad>"]
    roles = ["system", "user", "assistant"]
    vocab = {w: i for i, w in enumerate(specials + roles + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.add_special_tokens(specials)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        eos_token="<|im_end|>",
        pad_token="<pad>",
        chat_template=chat_template,
    )


def chat_llama(vocab_size: int, seed: int = 0) -> LlamaForCausalLM:
    """The random 4-layer Llama the chat tokenizer's tests use (tied embeddings, its special ids)."""
    return tiny_llama(
        vocab_size,
        seed=seed,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        eos_token_id=2,
        pad_token_id=3,
        bos_token_id=None,
    )


def distill_strategy(name: str, loss=None, *, vocab_size: int = 48, draft_vocab: int = 20, slots: int = 3):
    """A real distillation strategy (`specblock.train.distill`) in float64: a random 6-layer Llama target
    (online teacher, features from layers 2, 3, 4), a drafter `name` with K = `slots` moved off its
    initialisation (shift projections start at [I | 0]) so that every parameter matters, two TTT blocks."""
    from specblock.train.distill import StrategyConfig
    from specblock.train.drafters import build_drafter, train_spec
    from specblock.train.losses import CurriculumConfig, LossConfig
    from specblock.train.modeling import Eagle3Config, SpecBlockConfig

    target = tiny_llama(vocab_size, layers=6).double()
    d2t = torch.randperm(vocab_size)[:draft_vocab].sort().values
    cfg = {
        "specblock": SpecBlockConfig(block_size=slots, draft_vocab_size=draft_vocab, rank_hidden=16),
        "eagle3": Eagle3Config(ttt_length=slots, draft_vocab_size=draft_vocab),
    }[name]
    embed, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    module = build_drafter(name, cfg, target.config, embed, head, d2t).double()
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.05 * torch.randn_like(p))
    loss = loss if loss is not None else LossConfig(curriculum=CurriculumConfig(0, 10), rank_budget=2)
    return train_spec(name).strategy(
        module, target, [2, 3, 4], loss, StrategyConfig(num_ttt_blocks=2, seed=1)
    )


def save_chat_data(tiny_chat, root, questions: list[str], answer: str, extra_rows: tuple = ()):
    """The tiny chat target saved to root/target and a ShareGPT corpus at root/corpus.json with one
    exchange per question (ids r0, r1, ...), then `extra_rows` as given. Returns (target dir, corpus)."""
    import json

    model, tok = tiny_chat
    model.save_pretrained(root / "target")
    tok.save_pretrained(root / "target")
    rows = [
        {"id": f"r{i}", "conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": answer}]}
        for i, q in enumerate(questions)
    ]
    (root / "corpus.json").write_text(json.dumps([*rows, *extra_rows]))
    return root / "target", root / "corpus.json"


class Interrupting:
    """Wraps a FeatureTarget, counts its forwards (`calls`) and raises KeyboardInterrupt on the
    `stop_at`-th (like a Ctrl-C or a killed rank mid-capture)."""

    def __init__(self, target, stop_at: int | None = None):
        self.target, self.stop_at, self.calls = target, stop_at, 0

    def __getattr__(self, name):
        return getattr(self.target, name)

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.stop_at:
            raise KeyboardInterrupt
        return self.target(*args, **kwargs)
