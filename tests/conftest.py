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

from tiny_models import chat_llama, chat_tokenizer  # noqa: E402  (tests/support, see pyproject)


@pytest.fixture(scope="session")
def tiny_chat():
    """(model, tokenizer): a random 4-layer Llama over the tiny ChatML tokenizer's vocabulary."""
    tok = chat_tokenizer()
    return chat_llama(len(tok)), tok
