"""Shared test settings: offline hub, deterministic torch, few threads."""

import os

# Never touch the network from tests: a hub id without this hangs ~47 s before failing here.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")

import torch  # noqa: E402

torch.set_num_threads(1)
