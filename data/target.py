"""The frozen target: loading (hub id, local folder, or GGUF) and `FeatureTarget`, which returns the hidden
states a drafter reads (the embedded targets, converted or made once: embedded.py).

Layer convention (HF `output_hidden_states`): for an N-layer target there are N+1 hidden states;
hidden_states[0] is the embedding output and hidden_states[i] (1 <= i < N) the output of decoder layer i
(layers counted from 1). hidden_states[N] is NOT the raw output of layer N: transformers replaces it with
the final-norm output, i.e. `last_hidden`, what the LM head reads. `feature_layers` are indices into this
tuple. The default follows EAGLE-3 and SpecBlock's HF harness, which write `[1+1, N//2-1+1, N-4+1]`
(decoder layer ids 1, N//2-1, N-4, each +1 for the embedding entry) = hidden_states [2, N//2, N-3].
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from gguf import GGUFReader
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from .errors import BadInputError
from .hardware import bf16_matmul_pays

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
AUTO_DTYPE = "auto"  # target.dtype=auto: the faster precision on this device (auto_dtype)

DEFAULT_TARGET_DIR = "checkpoints/targets/SmolLM2-135M-Instruct"
# The debug experiment's target: a random 8-layer Llama over SmolLM2's tokenizer (made in seconds, offline;
# 8 layers so that the default feature layers [2, N//2, N-3] are distinct).
TINY_TARGET_DIR = "checkpoints/targets/tiny-random-llama"
# The EAGLE-3 default reads three layers, needing hidden_states [2, N//2, N-3] to exist and be below N.
MIN_LAYERS_FOR_DEFAULT = 4


@dataclass
class TargetConfig:
    """Which target to load and how. `gguf_file` names a file inside `name_or_path` (a folder or hub repo);
    `feature_layers` are hidden_states indices (None = default_feature_layers(N))."""

    name_or_path: str = DEFAULT_TARGET_DIR
    gguf_file: str | None = None
    revision: str | None = None
    dtype: str = "bfloat16"
    device: str = "cpu"
    trust_remote_code: bool = False
    feature_layers: list[int] | None = None
    # transformers' attention kernel ("sdpa", "eager", ...; None = its default). Not part of a cache's
    # identity: kernels differ only in rounding. On a 2-core AVX512-BF16 CPU "eager" decodes batches of 32-64
    # in bf16 1.4x faster than "sdpa" (scripts/bench_data.py --attn eager).
    attn_implementation: str | None = None
    # set when dtype was "auto" (resolved here: auto_dtype): where that gave bf16 on a CPU, the evaluation
    # then measures which precision decodes faster (evaluate/precision.py); not meant to be set by hand
    dtype_auto: bool = False

    def __post_init__(self):
        if self.dtype == AUTO_DTYPE:
            self.dtype, self.dtype_auto = auto_dtype(self.device), True
        if self.dtype not in DTYPES:
            raise ValueError(f"target.dtype={self.dtype!r} is not one of {sorted(DTYPES)} or {AUTO_DTYPE!r}")
        if self.feature_layers is not None:
            self.feature_layers = list(self.feature_layers)
            if not self.feature_layers or any(i < 0 for i in self.feature_layers):
                raise ValueError(
                    f"target.feature_layers must be non-negative hidden_states indices, "
                    f"got {self.feature_layers}"
                )

    @property
    def target_id(self) -> str:
        """What manifests record as the target: the folder or hub id, plus the GGUF file if any."""
        return self.name_or_path + (f"::{self.gguf_file}" if self.gguf_file else "")


def auto_dtype(device: str) -> str:
    """target.dtype=auto: bfloat16 on a CUDA device that supports it, and on a CPU whose bf16 matrix products
    are measured faster than float32 ones (hardware.bf16_matmul_pays; the flags alone picked bf16 on an Intel
    Xeon where it is the slower precision); else float32. The evaluation measures its own decoding on top
    (evaluate/precision.py)."""
    if device.startswith("cuda"):
        return "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "float32"
    return "bfloat16" if bf16_matmul_pays() else "float32"


def eos_ids(tokenizer, model) -> list[int]:
    """End-of-sequence ids: the tokenizer's and the generation config's (chat models end turns there)."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if gen_eos is not None:
        ids.update([gen_eos] if isinstance(gen_eos, int) else gen_eos)
    return sorted(ids)


def default_feature_layers(num_layers: int) -> list[int]:
    """hidden_states indices [2, N//2, N-3] (low, mid, high) for an N-layer target (see module docstring)."""
    if num_layers < MIN_LAYERS_FOR_DEFAULT:
        raise ValueError(
            f"the default feature layers need a target with >= {MIN_LAYERS_FOR_DEFAULT} layers, "
            f"got {num_layers}; set target.feature_layers explicitly"
        )
    return [1 + 1, num_layers // 2 - 1 + 1, num_layers - 4 + 1]


def _looks_local(name: str) -> bool:
    """A hub id is 'org/name'; anything that exists, starts with . / ~, or is nested deeper is a path."""
    return Path(name).expanduser().exists() or name.startswith((".", "/", "~")) or name.count("/") > 1


def check_gguf(path: str | Path) -> None:
    """Raises BadInputError naming `path` unless it is a readable GGUF file describing a model
    (right magic bytes, tensors that fit in the file, a `general.architecture`)."""
    path = Path(path)
    if not path.is_file():
        raise BadInputError(str(path), None, None, "GGUF file not found")
    try:
        reader = GGUFReader(path)
    except (ValueError, OSError, IndexError, KeyError) as err:
        raise BadInputError(
            str(path), None, None, f"not a readable GGUF model file (truncated or not a GGUF at all): {err}"
        ) from err
    if "general.architecture" not in reader.fields or not reader.tensors:
        raise BadInputError(str(path), None, "general.architecture", "GGUF file holds no model")


def _load_kwargs(cfg: TargetConfig) -> dict:
    kwargs = {"revision": cfg.revision, "trust_remote_code": cfg.trust_remote_code}
    if cfg.gguf_file is not None:
        kwargs["gguf_file"] = cfg.gguf_file
    return kwargs


def load_target_config(cfg: TargetConfig) -> transformers.PretrainedConfig:
    """The target's model config alone (shapes, RoPE, vocabulary size), without its weights."""
    return transformers.AutoConfig.from_pretrained(cfg.name_or_path, **_load_kwargs(cfg))


def load_tokenizer(cfg: TargetConfig) -> PreTrainedTokenizerBase:
    """The target's tokenizer alone (what a step that needs no forward pass reads)."""
    local = _looks_local(cfg.name_or_path)
    if local and not Path(cfg.name_or_path).expanduser().exists():
        default = cfg.name_or_path == DEFAULT_TARGET_DIR
        hint = " (run scripts/fetch_smollm2.py to create it)" if default else ""
        raise FileNotFoundError(f"target {cfg.name_or_path!r} does not exist{hint}")
    if local and cfg.gguf_file is not None:
        check_gguf(Path(cfg.name_or_path).expanduser() / cfg.gguf_file)
    return AutoTokenizer.from_pretrained(cfg.name_or_path, **_load_kwargs(cfg))


def load_target(cfg: TargetConfig) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Loads the causal LM and its tokenizer, frozen and in eval mode on cfg.device in cfg.dtype.
    A GGUF is dequantized to dense weights (slow: convert it once with `convert_gguf`)."""
    tokenizer = load_tokenizer(cfg)
    kwargs = _load_kwargs(cfg)
    if cfg.attn_implementation is not None:
        kwargs["attn_implementation"] = cfg.attn_implementation
    if cfg.gguf_file is not None and hasattr(transformers, "GgufConfig"):
        # Newer transformers may keep GGUF weights packed (not trainable, not serialisable); ask for dense.
        kwargs["quantization_config"] = transformers.GgufConfig(dequantize=True)
    model = AutoModelForCausalLM.from_pretrained(cfg.name_or_path, dtype=DTYPES[cfg.dtype], **kwargs)
    return freeze(model.to(cfg.device)), tokenizer


def freeze(model: PreTrainedModel) -> PreTrainedModel:
    """eval() and no parameter takes a gradient: the target is for inference only."""
    model.eval()
    model.requires_grad_(False)
    return model


def concat_features(hidden_states: tuple[torch.Tensor, ...], layers: list[int]) -> torch.Tensor:
    """`output_hidden_states` (N+1 tensors [B,T,H]) -> [B,T,len(layers)*H]: the chosen layers side by
    side, in `layers` order (what a drafter reads; online and cached features alike)."""
    return torch.cat([hidden_states[i] for i in layers], dim=-1)


@dataclass
class TargetHead:
    """The frozen LM head as a function: final hidden state [..., H] -> logits [..., V] as the model
    computes them, the output embedding (weight [V, H], bias [V] or None) then, for Gemma-2-style heads,
    the soft cap tanh(z / cap) * cap. In the head's dtype, at least float32. The one implementation of
    "logits from a stored last_hidden": `FeatureTarget.logits_from_hidden` and the trainer's offline
    features both call it, so a cached run's teacher is the online one."""

    weight: torch.Tensor
    bias: torch.Tensor | None = None
    softcap: float | None = None
    linear: torch.nn.Module | None = None  # the live head module (its kernel: weight_layout=packed)

    @classmethod
    def of(cls, model: PreTrainedModel, copy: bool = False) -> TargetHead:
        """The head of `model` (its live weights; `copy`: detached clones that outlive it)."""
        head = model.get_output_embeddings()
        weight, bias = head.weight.detach(), getattr(head, "bias", None)
        bias = bias.detach() if bias is not None else None
        if copy:
            weight, bias = weight.clone(), (bias.clone() if bias is not None else None)
        # Gemma-2-style heads squash the logits; the recomputed logits must do the same.
        softcap = getattr(model.config.get_text_config(), "final_logit_softcapping", None)
        linear = head if not copy and isinstance(head, torch.nn.Linear) else None
        return cls(weight, bias, softcap, linear)

    def to(self, device: torch.device | str) -> TargetHead:
        bias = self.bias.to(device) if self.bias is not None else None
        return TargetHead(self.weight.to(device), bias, self.softcap)

    def __call__(self, last_hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """logits [..., V]: float32 (at least), or with `upcast=False` in the head's own dtype where no soft cap
        applies (bf16 stays bf16: a reader that upcasts only the columns it needs gets the same bits, at half
        the memory traffic of a [..., 49k] float32 copy)."""
        x = last_hidden.to(self.weight.device, self.weight.dtype)
        if self.linear is not None and self.linear.weight.data_ptr() == self.weight.data_ptr():
            logits = self.linear(x)  # the module's own forward: the same product, its kernel
        else:
            logits = torch.nn.functional.linear(x, self.weight, self.bias)
        if self.softcap is None and not upcast:
            return logits
        logits = logits.float() if logits.element_size() < 4 else logits
        return logits if self.softcap is None else torch.tanh(logits / self.softcap) * self.softcap


@dataclass
class TargetOutput:
    """features: [B,T,len(layers)*H], the chosen hidden states concatenated in feature_layers order
    (low|mid|high); last_hidden: [B,T,H] after the final norm; logits: [B,T,V] float32, or None."""

    features: torch.Tensor
    last_hidden: torch.Tensor
    logits: torch.Tensor | None


class FeatureTarget:
    """A frozen causal LM that returns the hidden states a drafter reads. Batches are right-padded
    (HF Llama-style models take positions from the index, not from the mask)."""

    def __init__(
        self,
        model: PreTrainedModel,
        feature_layers: list[int] | None = None,
        *,
        target_id: str = "",
        revision: str | None = None,
    ):
        self.model = freeze(model)
        text_config = model.config.get_text_config()
        self.num_layers: int = text_config.num_hidden_layers
        self.hidden_size: int = text_config.hidden_size
        self.vocab_size: int = text_config.vocab_size
        layers = default_feature_layers(self.num_layers) if feature_layers is None else list(feature_layers)
        if not layers or not all(0 <= i <= self.num_layers for i in layers):
            raise ValueError(
                f"feature_layers {layers} must be hidden_states indices in [0, {self.num_layers}]"
            )
        self.feature_layers = layers
        self.target_id, self.revision = target_id, revision

    @classmethod
    def from_config(cls, cfg: TargetConfig) -> tuple[FeatureTarget, PreTrainedTokenizerBase]:
        model, tokenizer = load_target(cfg)
        return cls(model, cfg.feature_layers, target_id=cfg.target_id, revision=cfg.revision), tokenizer

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.no_grad()
    def __call__(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *, with_logits: bool = True
    ) -> TargetOutput:
        """input_ids, attention_mask: [B,T] (1 = real token); with_logits=False skips the [B,T,V] head."""
        mask = None if attention_mask is None else attention_mask.to(self.device)
        out = self.model.base_model(
            input_ids=input_ids.to(self.device),
            attention_mask=mask,
            use_cache=False,
            output_hidden_states=True,
        )
        return self.outputs(out, with_logits=with_logits)

    def outputs(self, out, *, with_logits: bool = True) -> TargetOutput:
        """A base-model output called with output_hidden_states=True -> the TargetOutput (how a caller that
        runs the model itself, e.g. with a KV cache, reads the same features)."""
        states = out.hidden_states
        if len(states) != self.num_layers + 1:
            raise RuntimeError(
                f"{type(self.model).__name__} returned {len(states)} hidden states, expected "
                f"num_hidden_layers + 1 = {self.num_layers + 1}; the layer convention "
                "does not hold"
            )
        features = concat_features(states, self.feature_layers)  # [B,T,L*H]
        last_hidden = out.last_hidden_state  # [B,T,H]
        logits = self.logits_from_hidden(last_hidden) if with_logits else None
        return TargetOutput(features=features, last_hidden=last_hidden, logits=logits)

    def logits_from_hidden(self, last_hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] final hidden state -> [..., V] float32 logits through the frozen LM head (how stored
        features give back the target's logits; `TargetHead`). Gradients flow to `last_hidden` if it
        needs them."""
        return TargetHead.of(self.model)(last_hidden).float()
