"""Shared test settings: offline hub, deterministic torch, few threads."""

import os

# Never touch the network from tests: a hub id without this hangs ~47 s before failing here.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")

import torch  # noqa: E402

torch.set_num_threads(1)

import pytest  # noqa: E402

# A ChatML-style template (SmolLM2 uses ChatML), written here so tests need no download.
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WORDS = (
    "the a cat dog sat on mat and ran fast slow red blue one two three four five is was what why how".split()
)


def make_tiny_tokenizer(chat_template: str = CHATML):
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


def make_tiny_llama(
    vocab_size: int, hidden: int = 32, layers: int = 4, heads: int = 4, kv_heads: int = 2, seed: int = 0
):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        eos_token_id=2,
        pad_token_id=3,
        bos_token_id=None,
    )
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="session")
def tiny_chat():
    """(model, tokenizer): a random 4-layer Llama over the tiny ChatML tokenizer's vocabulary."""
    tok = make_tiny_tokenizer()
    return make_tiny_llama(len(tok)), tok
