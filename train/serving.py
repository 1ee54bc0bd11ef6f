"""EAGLE-3 drafters as checkpoints that serving engines load (vLLM, SGLang, vllm-project/speculators).

Two folders beside `<run>/drafter/` (which stays the project's own format):

  drafter-vllm/          the native EAGLE-3 layout (`LlamaForCausalLMEagle3`) that vLLM and SGLang load
  drafter-speculators/   the speculators format (`speculators_model_type: eagle3`), which vLLM also loads

How our Eagle3Drafter maps onto the engines' EAGLE-3 module, checked against
  vLLM    vllm/model_executor/models/llama_eagle3.py (LlamaDecoderLayer, LlamaModel.load_weights,
          Eagle3LlamaForCausalLM.load_weights / compute_logits),
          vllm/transformers_utils/configs/speculators/{base,algos}.py (update_eagle3),
          vllm eagle3_utils.get_eagle3_aux_layers_from_config, vllm/model_executor/models/llama.py
          (aux hidden states = the input of decoder layer i, i.e. HF hidden_states[i]);
  SGLang  python/sglang/srt/models/llama_eagle3.py (LlamaDecoderLayer, LlamaForCausalLMEagle3.load_weights),
          python/sglang/srt/model_executor/model_runner.py (reads eagle_config.eagle_aux_hidden_state_layer_ids),
          python/sglang/srt/models/llama.py set_eagle3_layers_to_capture (captures layer id + 1);
  speculators  src/speculators/models/eagle3/config.py (Eagle3SpeculatorConfig), src/speculators/config.py
          (SpeculatorsConfig, VerifierConfig), src/speculators/models/eagle3/core.py (layers.0.*, d2t offsets).

  ours                                       engines
  fc: Linear(3H, H) over [low|mid|high]      fc.weight, input 3 * target_hidden_size (same order)
  midlayer attention input                   first layer: cat[input_layernorm(embeds), hidden_norm(h)]
    cat[input_layernorm(emb), hidden_norm(h)]  -> q/k/v of input width 2H (fused qkv_proj: the engines
    q_proj/k_proj/v_proj of input width 2H        stack our separate q/k/v rows themselves)
  residual stream = h (pre-norm)             norm_before_residual = false: residual = h before hidden_norm
  midlayer.mlp gate/up/down (SwiGLU)         fused gate_up_proj, stacked by the engines' loaders
  norm(h_out) -> lm_head [Vd, H]             norm(hidden, residual) -> lm_head [draft_vocab_size, H]
  d2t: draft id -> target id                 d2t[i] = target_id(i) - i (offsets), t2d bool [V] (ignored)
  embed_tokens: frozen copy of the target's  not written: both engines share the target's embedding
RoPE: the target's, written in the legacy keys (rope_theta, rope_scaling) the engines read.
Anything our module cannot say faithfully in this layout is refused with a ServingExportError.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from transformers import PretrainedConfig

from specblock.data.io import atomic_path

from .modeling.common import drafter_layer_config

# The engines' fc reads exactly three target hidden states (vLLM: `target_hidden_size * 3`, SGLang:
# `hidden_size_in * 3`), so a drafter trained on another number of feature layers has no engine layout.
ENGINE_FEATURE_LAYERS = 3
# Weights in bf16, the dtype the published EAGLE-3 checkpoints use and the engines serve in.
ENGINE_DTYPE = torch.bfloat16
ENGINE_DTYPE_NAME = "bfloat16"
NATIVE_ARCHITECTURE = "LlamaForCausalLMEagle3"
SPECULATORS_ARCHITECTURE = "Eagle3Speculator"
# The RoPE types the engines' Llama rotary embedding knows under `rope_scaling.rope_type`.
KNOWN_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")


class ServingExportError(ValueError):
    """The drafter cannot be written faithfully in an engine's layout; the message says why."""


def check_exportable(module: torch.nn.Module, target_config: PretrainedConfig, layers: list[int]) -> None:
    """Raises ServingExportError unless `module` (an Eagle3Drafter) maps onto the engines' EAGLE-3."""
    n = target_config.get_text_config().num_hidden_layers
    if (
        len(layers) != ENGINE_FEATURE_LAYERS
        or module.feature_size != ENGINE_FEATURE_LAYERS * module.hidden_size
    ):
        raise ServingExportError(
            f"serving engines read exactly {ENGINE_FEATURE_LAYERS} target feature layers; this drafter "
            f"reads {len(layers)} ({layers})"
        )
    if len(set(layers)) != len(layers):  # the engines capture a layer once: 2 features for 3H of fc
        raise ServingExportError(f"feature layers {layers} repeat a layer; the engines capture each one once")
    # vLLM/SGLang capture the input of decoder layer i (HF hidden_states[i]) for i in [0, N); SGLang's
    # config holds i - 1, so hidden_states[0] (the embedding) cannot be named there, nor N (final norm).
    bad = [i for i in layers if not 1 <= i < n]
    if bad:
        raise ServingExportError(
            f"feature layers {bad} are not in [1, {n}): the engines capture decoder-layer inputs "
            "hidden_states[1..N-1] only"
        )
    layer = module.midlayer
    biased = [name for name, p in layer.named_parameters() if name.endswith(".bias")]
    if biased or module.fc.bias is not None:
        raise ServingExportError(f"the engines' EAGLE-3 layer has no biases; this drafter has {biased}")
    if layer.self_attn.q_proj.in_features != 2 * module.hidden_size:
        raise ServingExportError("the engines' first EAGLE-3 layer reads [embed; hidden] of width 2H")


def legacy_rope(target_config: PretrainedConfig) -> tuple[float, dict[str, Any] | None]:
    """The drafter's RoPE (the target's, as transformers-5 rope_parameters) -> (rope_theta, rope_scaling)."""
    params = dict(drafter_layer_config(target_config, 1).rope_parameters or {})
    theta = params.pop("rope_theta", None)
    if theta is None:
        raise ServingExportError("the target's RoPE settings have no rope_theta")
    rope_type = params.get("rope_type", "default")
    if rope_type not in KNOWN_ROPE_TYPES or params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ServingExportError(f"RoPE {params} has no legacy Llama form the engines' EAGLE-3 layer reads")
    if rope_type == "default":
        return float(theta), None
    params.pop("partial_rotary_factor", None)
    return float(theta), params


def native_config(module: torch.nn.Module, target_config: PretrainedConfig, layers: list[int]) -> dict:
    """config.json of the native layout (fields as vLLM's and SGLang's EAGLE-3 classes read them)."""
    lcfg = drafter_layer_config(target_config, 1)
    theta, scaling = legacy_rope(target_config)
    config = {
        "architectures": [NATIVE_ARCHITECTURE],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": lcfg.hidden_size,
        "intermediate_size": lcfg.intermediate_size,
        "num_attention_heads": lcfg.num_attention_heads,
        "num_key_value_heads": lcfg.num_key_value_heads,
        "head_dim": lcfg.head_dim,
        "rms_norm_eps": lcfg.rms_norm_eps,
        "hidden_act": lcfg.hidden_act,
        "max_position_embeddings": lcfg.max_position_embeddings,
        "rope_theta": theta,
        "rope_scaling": scaling,
        "vocab_size": lcfg.vocab_size,
        "draft_vocab_size": int(module.d2t.numel()),  # always: SGLang reads None as "the target's head"
        "target_hidden_size": lcfg.hidden_size,
        "tie_word_embeddings": False,  # SGLang ties lm_head to embed_tokens when true
        "attention_bias": False,
        "mlp_bias": False,
        "norm_before_residual": False,  # ours: the residual is h before hidden_norm
        "torch_dtype": ENGINE_DTYPE_NAME,
    }
    return config | aux_layer_keys(target_config, layers)


def engine_order(layers: list[int]) -> list[int]:
    """The engines concatenate the captured states in layer order (they append while looping over the
    decoder layers), whatever order the config lists: our feature block j sits at position
    engine_order(layers).index(j) there."""
    return sorted(range(len(layers)), key=lambda j: layers[j])


def aux_layer_keys(target_config: PretrainedConfig, layers: list[int]) -> dict[str, Any]:
    """The feature-layer keys (ascending), only when they differ from the engines' default
    [2, N//2, N-3]. vLLM reads the top-level `eagle_aux_hidden_state_layer_ids` as hidden_states indices
    (the input of decoder layer i); SGLang reads `eagle_config.eagle_aux_hidden_state_layer_ids` and
    captures id + 1, so it gets our indices minus one."""
    n = target_config.get_text_config().num_hidden_layers
    ascending = sorted(layers)
    if ascending == [2, n // 2, n - 3]:
        return {}
    return {
        "eagle_aux_hidden_state_layer_ids": ascending,
        "eagle_config": {
            "use_aux_hidden_state": True,
            "eagle_aux_hidden_state_layer_ids": [i - 1 for i in ascending],
        },
    }


def engine_state(module: torch.nn.Module, layer_prefix: str, layers: list[int]) -> dict[str, torch.Tensor]:
    """Our state dict in the engines' names: midlayer.* -> `layer_prefix`*, fc (its input blocks put in
    ascending layer order), norm and lm_head, all bf16; d2t as offsets (int64), t2d (bool [V]);
    embed_tokens left out (the engines share the target's)."""
    state: dict[str, torch.Tensor] = {}
    for name, tensor in module.state_dict().items():
        if name.startswith("embed_tokens.") or name in ("d2t", "t2d"):
            continue
        if not name.startswith(("midlayer.", "fc.", "norm.", "lm_head.")):
            raise ServingExportError(f"parameter {name!r} has no place in the engines' EAGLE-3 layout")
        key = layer_prefix + name.removeprefix("midlayer.") if name.startswith("midlayer.") else name
        state[key] = tensor.detach().to("cpu", ENGINE_DTYPE).contiguous()
    fc = state["fc.weight"]  # [H, F*H], input blocks in our feature order
    state["fc.weight"] = fc.view(fc.shape[0], len(layers), -1)[:, engine_order(layers)].reshape(fc.shape)
    d2t = module.d2t.detach().cpu().long()
    state["d2t"] = (d2t - torch.arange(d2t.numel())).contiguous()  # offsets: target_id(i) - i
    state["t2d"] = module.t2d.detach().cpu().bool().contiguous()
    return state


def speculators_config(
    module: torch.nn.Module, target_config: PretrainedConfig, layers: list[int], verifier: str
) -> dict[str, Any]:
    """config.json of the speculators format: the native fields split into transformer_layer_config and
    the top level, as Eagle3SpeculatorConfig writes them and vLLM's update_eagle3 reads them back."""
    native = native_config(module, target_config, layers)
    top = ("draft_vocab_size", "target_hidden_size", "norm_before_residual", "torch_dtype")
    layer = {k: v for k, v in native.items() if k not in top and not k.startswith("eagle_")}
    layer["architectures"] = ["LlamaForCausalLM"]
    config = {
        "architectures": [SPECULATORS_ARCHITECTURE],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": layer,
        "draft_vocab_size": native["draft_vocab_size"],
        "target_hidden_size": native["target_hidden_size"],
        # vLLM's update_eagle3 defaults a missing norm_before_residual to True: write ours explicitly.
        "norm_before_residual": False,
        "torch_dtype": ENGINE_DTYPE_NAME,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(module.block_size)}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": list(target_config.architectures or [])},
        },
    }
    if "eagle_aux_hidden_state_layer_ids" in native:  # speculators and vLLM read it at the top level
        config["eagle_aux_hidden_state_layer_ids"] = native["eagle_aux_hidden_state_layer_ids"]
    return config


def _write(out: Path, config: dict, state: dict[str, torch.Tensor]) -> Path:
    with atomic_path(out) as tmp:
        tmp.mkdir()
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out


def export_for_engines(
    module: torch.nn.Module,
    drafter_dir: str | Path,
    *,
    target_config: PretrainedConfig,
    feature_layers: list[int],
    verifier: str,
) -> list[Path]:
    """Writes `<drafter_dir>-vllm` and `<drafter_dir>-speculators` (each atomically) and returns them.
    `verifier`: the target's hub id or path, recorded in the speculators config."""
    check_exportable(module, target_config, feature_layers)
    drafter_dir = Path(drafter_dir)
    native = drafter_dir.with_name(drafter_dir.name + "-vllm")
    spec = drafter_dir.with_name(drafter_dir.name + "-speculators")
    return [
        _write(
            native,
            native_config(module, target_config, feature_layers),
            engine_state(module, "midlayer.", feature_layers),
        ),
        _write(
            spec,
            speculators_config(module, target_config, feature_layers, verifier),
            engine_state(module, "layers.0.", feature_layers),
        ),
    ]
