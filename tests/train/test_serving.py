"""Export for serving engines: the drafter-vllm / drafter-speculators folders reload, under the engines'
published loading rules, into an independent EAGLE-3 forward that reproduces our drafter's logits.

The reader and the forward below are written from the engines' code, not from our module:
  vLLM vllm/model_executor/models/llama_eagle3.py: `midlayer.` -> `layers.0.`, q/k/v stacked into one
    qkv_proj of input width 2H, gate/up into gate_up_proj, d2t offsets -> targets = arange + d2t, t2d
    skipped, embed_tokens shared with the target when absent; first layer: residual = h,
    x = cat[input_layernorm(embeds), hidden_norm(h)]; final norm(hidden + residual); the prenorm sum is
    the next step's hidden (no fc on it).
  SGLang python/sglang/srt/models/llama_eagle3.py: the same layer; hot_token_id = d2t + arange.
  speculators src/speculators/models/eagle3/core.py: `layers.0.*` names, the same d2t offsets.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig

from specblock.train.modeling import Eagle3Config, Eagle3Drafter
from specblock.train.serving import ServingExportError, check_exportable, export_for_engines

from tiny_models import llama_config

V, H, N_LAYERS, VD = 48, 32, 8, 20


def tiny_target_config(**kw) -> LlamaConfig:
    return llama_config(V, **({"hidden": H, "layers": N_LAYERS, "rms_norm_eps": 1e-5} | kw))


def make_drafter(target_config: LlamaConfig, seed: int = 0) -> tuple[Eagle3Drafter, torch.Tensor]:
    """A drafter with every parameter random (norms too), values already bf16-representable so that the
    bf16 export is lossless and logits can be compared in float32. Returns it and the target embedding."""
    g = torch.Generator().manual_seed(seed)
    embed = torch.randn(V, H, generator=g).bfloat16().float()
    d2t = torch.randperm(V, generator=g)[:VD].sort().values
    module = Eagle3Drafter(Eagle3Config(ttt_length=3, draft_vocab_size=VD), target_config, embed, embed, d2t)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if not name.startswith("embed_tokens"):
                p.copy_(
                    (torch.randn(p.shape, generator=g) * (0.3 if p.dim() > 1 else 1.0)).bfloat16().float()
                )
    return module.eval(), embed


# ---------------------------------------------------------------- the engines' rules, re-implemented


def read_engine_folder(folder, embed: torch.Tensor) -> tuple[dict, dict[str, torch.Tensor]]:
    """config.json + model.safetensors as an engine loads them: renamed to one decoder layer `L.`, fused
    qkv / gate_up, d2t offsets turned into target ids, the target's embedding shared."""
    config = json.loads((folder / "config.json").read_text())
    raw = load_file(str(folder / "model.safetensors"))
    assert "embed_tokens.weight" not in raw
    w = {}
    for name, t in raw.items():
        if name in ("t2d",):
            continue
        for prefix in ("midlayer.", "layers.0."):
            name = "L." + name.removeprefix(prefix) if name.startswith(prefix) else name
        w[name] = t
    w["L.qkv"] = torch.cat([w.pop(f"L.self_attn.{p}_proj.weight") for p in "qkv"]).float()
    w["L.gate_up"] = torch.cat([w.pop("L.mlp.gate_proj.weight"), w.pop("L.mlp.up_proj.weight")]).float()
    w["targets"] = torch.arange(w["d2t"].numel()) + w.pop("d2t")
    w["embed"] = embed
    return config, {k: v.float() if v.is_floating_point() else v for k, v in w.items()}


def rms(x, weight, eps):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x, pos, theta):
    """Neox-style rotary (the engines' Llama default): x [h, T, d], pos [T]."""
    d = x.shape[-1]
    freqs = pos[:, None].float() / theta ** (torch.arange(0, d, 2).float() / d)
    cos, sin = torch.cat([freqs, freqs], -1).cos(), torch.cat([freqs, freqs], -1).sin()
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def engine_step(cfg, w, h, tokens, pos, past=None):
    """One call of the engines' EAGLE-3 model on T new positions (batch 1): h [T, 3H] target features
    (through fc) or [T, H] the previous prenorm state; attention: causal among the new positions plus
    every cached key. Returns target-vocabulary logits [T, V] (-inf outside the draft vocabulary), the
    prenorm state [T, H] and the updated cache."""
    eps, hd = cfg["rms_norm_eps"], cfg["head_dim"]
    nq, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    if h.shape[-1] != cfg["hidden_size"]:
        h = h @ w["fc.weight"].T
    residual = h  # norm_before_residual = false
    x = torch.cat(
        [rms(w["embed"][tokens], w["L.input_layernorm.weight"], eps), rms(h, w["L.hidden_norm.weight"], eps)],
        -1,
    )
    assert x.shape[-1] == 2 * cfg["hidden_size"] == w["L.qkv"].shape[1]
    q, k, v = (x @ w["L.qkv"].T).split([nq * hd, nkv * hd, nkv * hd], -1)
    q, k, v = (t.view(len(tokens), -1, hd).transpose(0, 1) for t in (q, k, v))
    q, k = rope(q, pos, cfg["rope_theta"]), rope(k, pos, cfg["rope_theta"])
    if past is not None:
        k, v = torch.cat([past[0], k], 1), torch.cat([past[1], v], 1)
    n_past = 0 if past is None else past[0].shape[1]
    k_rep, v_rep = k.repeat_interleave(nq // nkv, 0), v.repeat_interleave(nq // nkv, 0)
    scores = q @ k_rep.transpose(1, 2) / hd**0.5
    allowed = torch.ones(len(tokens), n_past + len(tokens)).tril(n_past).bool()
    att = scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v_rep
    h = residual + att.transpose(0, 1).reshape(len(tokens), -1) @ w["L.self_attn.o_proj.weight"].T
    gate, up = (rms(h, w["L.post_attention_layernorm.weight"], eps) @ w["L.gate_up"].T).chunk(2, -1)
    prenorm = h + (torch.nn.functional.silu(gate) * up) @ w["L.mlp.down_proj.weight"].T
    draft_logits = rms(prenorm, w["norm.weight"], eps) @ w["lm_head.weight"].T
    logits = torch.full((len(tokens), cfg["vocab_size"]), float("-inf"))
    logits[:, w["targets"]] = draft_logits
    return logits, prenorm, (k, v)


def ours_in_target_vocab(module, draft_logits):
    out = torch.full((*draft_logits.shape[:-1], V), float("-inf"))
    out[..., module.d2t] = draft_logits
    return out


# ---------------------------------------------------------------- tests


@pytest.mark.parametrize("layers", [[2, 4, 5], [1, 3, 7], [7, 1, 3]])  # default, custom, unsorted
@pytest.mark.parametrize("flavour", ["vllm", "speculators"])
def test_engine_reader_reproduces_our_logits(tmp_path, layers, flavour):
    target_config = tiny_target_config()
    module, embed = make_drafter(target_config)
    export_for_engines(
        module, tmp_path / "drafter", target_config=target_config, feature_layers=layers, verifier="org/tiny"
    )
    cfg, w = read_engine_folder(tmp_path / f"drafter-{flavour}", embed)
    if flavour == "speculators":
        assert cfg["speculators_model_type"] == "eagle3" and cfg["norm_before_residual"] is False
        cfg = cfg["transformer_layer_config"] | {
            k: cfg[k] for k in ("draft_vocab_size", "target_hidden_size")
        }
    T = 6
    g = torch.Generator().manual_seed(1)
    features, tokens = torch.randn(T, 3 * H, generator=g), torch.randint(0, V, (T,), generator=g)
    with torch.no_grad():
        prefill = module.extend(features[None], tokens[None], position=0)
        ours, hidden = prefill.logits[:, :, 0], prefill.hidden[:, :, 0]  # one step per position: K' = 1
        nxt = torch.tensor([int(module.d2t[ours[0, -1].argmax()])])
        ours2 = module.draft(hidden[:, -1], nxt, prefill.cache, position=T, inherited=True).logits[:, 0]
    # the engines concatenate the captured states in ascending layer order
    order = sorted(range(3), key=lambda j: layers[j])
    engine_features = features.view(T, 3, H)[:, order].reshape(T, 3 * H)
    theirs, prenorm, cache = engine_step(cfg, w, engine_features, tokens, torch.arange(T))
    theirs2, _, _ = engine_step(cfg, w, prenorm[-1:], nxt, torch.tensor([T]), cache)
    torch.testing.assert_close(theirs, ours_in_target_vocab(module, ours[0]), atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(theirs2, ours_in_target_vocab(module, ours2), atol=2e-4, rtol=1e-4)


def test_native_config_and_weights(tmp_path):
    target_config = tiny_target_config(rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    module, _ = make_drafter(target_config)
    native, spec = export_for_engines(
        module, tmp_path / "drafter", target_config=target_config, feature_layers=[2, 4, 5], verifier="org/t"
    )
    cfg = json.loads((native / "config.json").read_text())
    expected = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
        "hidden_size": H, "head_dim": H // 4, "num_key_value_heads": 2, "vocab_size": V, "draft_vocab_size": VD,
        "target_hidden_size": H, "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
        "norm_before_residual": False, "torch_dtype": "bfloat16", "rope_theta": 5e5, "rope_scaling": None,
    }  # fmt: skip
    assert {k: cfg[k] for k in expected} == expected
    assert "eagle_aux_hidden_state_layer_ids" not in cfg and "eagle_config" not in cfg  # the default layers
    w = load_file(str(native / "model.safetensors"))
    assert w["d2t"].dtype == torch.int64 and torch.equal(w["d2t"] + torch.arange(VD), module.d2t)
    assert w["t2d"].dtype == torch.bool and w["t2d"].shape == (V,) and int(w["t2d"].sum()) == VD
    assert {t.dtype for k, t in w.items() if k not in ("d2t", "t2d")} == {torch.bfloat16}
    assert "fc.weight" in w and "midlayer.self_attn.q_proj.weight" in w and w["fc.weight"].shape == (H, 3 * H)
    specw = load_file(str(spec / "model.safetensors"))
    assert "layers.0.hidden_norm.weight" in specw and not any(k.startswith("midlayer.") for k in specw)
    scfg = json.loads((spec / "config.json").read_text())["speculators_config"]
    assert scfg["proposal_methods"] == [{"proposal_type": "greedy", "speculative_tokens": 3}]
    assert scfg["verifier"]["name_or_path"] == "org/t"


def test_feature_layer_keys_follow_each_engine_convention(tmp_path):
    target_config = tiny_target_config()
    module, _ = make_drafter(target_config)
    native, spec = export_for_engines(
        module, tmp_path / "d", target_config=target_config, feature_layers=[7, 1, 3], verifier="x"
    )
    cfg = json.loads((native / "config.json").read_text())
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 3, 7]  # vLLM: hidden_states indices
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 6]  # SGLang adds 1 back
    assert json.loads((spec / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"] == [1, 3, 7]


@pytest.mark.parametrize(
    "layers, message",
    [([2, 4], "exactly 3"), ([0, 4, 5], "not in \\[1, 8\\)"), ([2, 4, 8], "not in"), ([2, 2, 1], "repeat")],
)
def test_refuses_what_the_engines_cannot_load(tmp_path, layers, message):
    target_config = tiny_target_config()
    module, _ = make_drafter(target_config)
    with pytest.raises(ServingExportError, match=message):
        check_exportable(module, target_config, layers)
    with pytest.raises(ServingExportError):
        export_for_engines(
            module, tmp_path / "d", target_config=target_config, feature_layers=layers, verifier="x"
        )
    assert not (tmp_path / "d-vllm").exists()


def test_refuses_rope_without_a_legacy_form():
    from specblock.train.serving import legacy_rope

    cfg = tiny_target_config(
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}
    )
    with pytest.raises(ServingExportError, match="legacy"):
        legacy_rope(cfg)
    llama3 = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}  # fmt: skip
    theta, scaling = legacy_rope(tiny_target_config(rope_parameters=llama3))
    assert theta == 5e5 and scaling["rope_type"] == "llama3" and "rope_theta" not in scaling


@pytest.mark.parametrize("name", ["specblock", "eagle3"])
def test_project_folder_loads_in_one_call_without_the_target(tmp_path, name):
    """load_drafter(folder) needs nothing but the folder: the target id recorded in it does not exist."""
    from specblock.train.export import export_drafter, load_drafter
    from specblock.train.drafters import build_drafter, train_spec

    target_config = tiny_target_config()
    embed = torch.randn(V, H)
    drafter_cfg = train_spec(name).config()
    module = build_drafter(name, drafter_cfg, target_config, embed, embed).eval()
    folder = export_drafter(
        module, tmp_path / "drafter", name=name, drafter_cfg=drafter_cfg, target_config=target_config,
        target_id=str(tmp_path / "no-such-target"), target_revision=None, feature_layers=[2, 4, 5],
    )  # fmt: skip
    loaded, meta = load_drafter(folder)
    assert meta["architecture"] == name and not (tmp_path / "no-such-target").exists()
    g = torch.Generator().manual_seed(0)
    features, ids = (
        torch.randn(1, 5, module.feature_size, generator=g),
        torch.randint(0, V, (1, 5), generator=g),
    )
    with torch.no_grad():
        torch.testing.assert_close(loaded(features, ids).logits, module(features, ids).logits)
