"""data.regenerate.backend=vllm without vLLM: one clear error when it is missing, and the whole path driven
by a fake `vllm` module (in sys.modules) that checks what it receives and answers canned tokens."""

import json
import sys
import types
from types import SimpleNamespace

import pytest

from tiny_models import save_chat_data

from specblock.data import prepare as prep
from specblock.data import vllm_backend
from specblock.data.config import PrepareConfig
from specblock.data.corpora import CorpusConfig
from specblock.data.regenerate import RegenerateConfig, regenerate
from specblock.data.target import TargetConfig
from specblock.data.vllm_backend import BackendUnavailableError
from specblock.data.world import World

ANSWER = "the cat sat"


class FakeVllm(types.ModuleType):
    """vllm's LLM / SamplingParams as this code uses them; records the engine's and each request's
    arguments and answers every prompt with `answer_ids`."""

    def __init__(self, answer_ids: list[int]):
        super().__init__("vllm")
        self.engines, self.requests = [], []
        fake = self

        class LLM:
            def __init__(self, **kwargs):
                fake.engines.append(kwargs)

            def generate(self, prompts, sampling_params, use_tqdm=True):
                assert len(sampling_params) == len(prompts)  # paired one by one
                fake.requests.append((prompts, [p.kwargs for p in sampling_params]))
                return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=answer_ids)]) for _ in prompts]

        class SamplingParams:
            def __init__(self, **kwargs):
                self.kwargs = kwargs

        self.LLM, self.SamplingParams = LLM, SamplingParams


@pytest.fixture()
def on_disk(tiny_chat, tmp_path):
    """(target folder, tokenizer, corpus file) for the data stage."""
    questions = ["what is the dog " * (1 + i) for i in range(3)]
    target, corpus = save_chat_data(tiny_chat, tmp_path, questions, "one two")  # answers: the engine's
    return target, tiny_chat[1], corpus


def config(on_disk, out, **regen) -> PrepareConfig:
    target, _, corpus = on_disk
    return PrepareConfig(
        out_dir=str(out),
        max_length=64,
        target=TargetConfig(name_or_path=str(target), dtype="float32"),
        corpus=CorpusConfig(source=str(corpus)),
        regenerate=RegenerateConfig(backend="vllm", max_new_tokens=6, max_prompt_tokens=32, **regen),
    )


def test_missing_vllm_is_one_clear_error_before_any_work(on_disk, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # what `import vllm` meets where it is not installed
    with pytest.raises(BackendUnavailableError) as err:
        prep.prepare(config(on_disk, tmp_path / "out"))
    assert "pip install vllm" in str(err.value) and "specblock[vllm]" in str(err.value)
    assert "data.regenerate.backend=vllm" in str(err.value)
    assert not (tmp_path / "out" / "regenerated.jsonl").exists()
    with pytest.raises(ValueError, match="regenerate.backend='sglang' is not one of"):
        RegenerateConfig(backend="sglang")


def test_the_data_stage_regenerates_through_vllm(on_disk, tmp_path, monkeypatch):
    target, tok, _ = on_disk
    fake = FakeVllm(tok(ANSWER, add_special_tokens=False)["input_ids"] + [tok.eos_token_id])
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.setattr(prep, "load_target", lambda cfg: pytest.fail("vllm regenerates without HF weights"))
    result = prep.prepare(config(on_disk, tmp_path / "out", batch_size=2))
    assert fake.engines == [
        dict(
            model=str(target),
            revision=None,
            dtype="float32",
            trust_remote_code=False,
            seed=0,
            max_model_len=32 + 6,
        )
    ]
    assert [len(prompts) for prompts, _ in fake.requests] == [2, 1]  # the configured batches
    prompts, params = fake.requests[0]
    text = tok.apply_chat_template(
        [{"role": "user", "content": "what is the dog "}], add_generation_prompt=True, tokenize=False
    )
    assert prompts[0] == {"prompt_token_ids": tok(text, add_special_tokens=False)["input_ids"]}
    assert params[0] == dict(
        n=1, temperature=0.0, top_p=1.0, max_tokens=6, stop_token_ids=[tok.eos_token_id], seed=None
    )
    rows = [json.loads(line) for line in (tmp_path / "out" / "regenerated.jsonl").read_text().splitlines()]
    assert [r["turns"][-1] for r in rows] == [{"role": "assistant", "content": ANSWER}] * 3
    assert result.num_rows == 3


def test_sampled_rows_get_their_own_seeds_and_ranks_one_engine_each(on_disk, tmp_path, monkeypatch):
    target, tok, _ = on_disk
    fake = FakeVllm([tok.eos_token_id])
    monkeypatch.setitem(sys.modules, "vllm", fake)
    cfg = RegenerateConfig(backend="vllm", temperature=0.7, batch_size=3, max_prompt_tokens=5, seed=4)
    engine = vllm_backend.load(TargetConfig(name_or_path=str(target)), cfg, World(1, 2))
    assert fake.engines[0]["distributed_executor_backend"] == "external_launcher"
    assert fake.engines[0]["data_parallel_size"] == 2 and fake.engines[0]["seed"] == 4
    convs = [(f"c{i}", [{"role": "user", "content": "one two three four five six"}]) for i in range(6)]
    regenerate(engine, tok, convs, tmp_path / "r.jsonl", cfg)
    seeds = [p["seed"] for _, params in fake.requests for p in params]
    assert len(set(seeds)) == 6 and None not in seeds
    assert all(len(p["prompt_token_ids"]) == 5 for prompts, _ in fake.requests for p in prompts)  # cut left
    with pytest.raises(ValueError, match="convert it once"):
        vllm_backend.load(TargetConfig(name_or_path=str(target), gguf_file="m.gguf"), cfg, World())
