"""`data.regenerate.backend=vllm`: regeneration through vLLM's offline engine (`pip install vllm`, or the
extra `specblock[vllm]`). Not run on our CPU machines: the tests drive it with a fake `vllm` module.

The prompts are the hf backend's: the chat template's text, tokenized without added special tokens and
cut from the left to max_prompt_tokens; vLLM gets them as token ids, so both backends read the same tokens,
and the answers are decoded by the target's tokenizer, as in the hf backend.

vLLM's offline API as used here (vllm/entrypoints/llm.py, docs.vllm.ai "Offline Inference"):
`LLM.generate(prompts, sampling_params)` takes TokensPrompt dicts `{"prompt_token_ids": [...]}` and a list of
`SamplingParams` "paired one by one with the prompts", and returns RequestOutputs "in the same order as
the input prompts"; `output.outputs[0].token_ids` is the completion. temperature=0 is greedy.
Several ranks follow vLLM's torchrun data-parallel example (examples/offline_inference/torchrun_dp_example.py):
`distributed_executor_backend="external_launcher"` makes each launched process one engine of
`data_parallel_size` = number of ranks, with the rows split outside vLLM (our batches by rank) and an
explicit seed shared by all ranks.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from transformers import GenerationConfig

from .target import TargetConfig, eos_ids
from .world import World

if TYPE_CHECKING:
    from .regenerate import RegenerateConfig

VLLM_INSTALL = "pip install vllm (or the extra: pip install 'specblock[vllm]')"


class BackendUnavailableError(ValueError):
    """The configured regeneration backend cannot run in this environment."""


def import_vllm():
    """The vllm module, or one clear error naming what to install."""
    try:
        return importlib.import_module("vllm")
    except ImportError as err:
        raise BackendUnavailableError(
            f"data.regenerate.backend=vllm needs vLLM, which is not installed here ({err}): {VLLM_INSTALL}; "
            "or set data.regenerate.backend=hf"
        ) from err


@dataclass
class VllmTarget:
    """The loaded engine, and the target's generation config (its end-of-turn ids stop the answers, as
    `eos_ids` reads them off an HF model's `generation_config`)."""

    llm: Any
    generation_config: GenerationConfig | None


def load(target: TargetConfig, cfg: RegenerateConfig, world: World) -> VllmTarget:
    """Builds vllm.LLM for the target: dtype and trust_remote_code from data.target, the context just long
    enough for a prompt and its answer (the KV cache reserves no more), and one engine per rank."""
    vllm = import_vllm()
    if target.gguf_file is not None:
        raise ValueError(
            "data.regenerate.backend=vllm loads a safetensors folder or hub id, not "
            f"data.target.gguf_file={target.gguf_file!r}: convert it once (specblock.data.embedded.convert_gguf) "
            "and point data.target.name_or_path at the folder"
        )
    kwargs: dict[str, Any] = dict(
        model=target.name_or_path,
        revision=target.revision,
        dtype=target.dtype,
        trust_remote_code=target.trust_remote_code,
        seed=cfg.seed,
        max_model_len=cfg.max_prompt_tokens + cfg.max_new_tokens,
    )
    if world.size > 1:
        kwargs.update(distributed_executor_backend="external_launcher", data_parallel_size=world.size)
    return VllmTarget(vllm.LLM(**kwargs), _generation_config(target))


def _generation_config(target: TargetConfig) -> GenerationConfig | None:
    """The target's generation_config.json, or None: the file is optional (the tokenizer's EOS remains)."""
    try:
        return GenerationConfig.from_pretrained(target.name_or_path, revision=target.revision)
    except OSError:
        return None


def generate(model: VllmTarget, tokenizer, texts: list[str], cfg: RegenerateConfig, seed: int) -> list[str]:
    """One batch of chat-templated prompt texts -> answers. Sampled rows get seeds of their own derived
    from the batch's `seed` (distinct across batches and rounds); greedy rows need none."""
    vllm = import_vllm()
    prompts = [
        {"prompt_token_ids": tokenizer(text, add_special_tokens=False)["input_ids"][-cfg.max_prompt_tokens :]}
        for text in texts
    ]
    stop = eos_ids(tokenizer, model)
    params = [
        vllm.SamplingParams(
            n=1,
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            max_tokens=cfg.max_new_tokens,
            stop_token_ids=stop,
            seed=None if cfg.temperature == 0 else seed * cfg.batch_size + row,
        )
        for row in range(len(prompts))
    ]
    outputs = model.llm.generate(prompts, params, use_tqdm=False)
    return [tokenizer.decode(out.outputs[0].token_ids, skip_special_tokens=True).strip() for out in outputs]
