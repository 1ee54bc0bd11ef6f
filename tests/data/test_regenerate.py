import copy
import json

import pytest

from specblock.data import regenerate as regen
from specblock.data.packed import PackedLinear, packing_available
from specblock.data.regenerate import RegenerateConfig, read_done, regenerate

CONVS = [
    (
        f"c{i}",
        [
            {"role": "user", "content": "what is the cat"},
            {"role": "assistant", "content": "one two"},
            {"role": "user", "content": "why"},
            {"role": "assistant", "content": "three"},
        ],
    )
    for i in range(7)
]


def cfg(**kw):
    return RegenerateConfig(max_new_tokens=5, batch_size=3, **kw)


def test_answers_are_rewritten_by_the_model_round_by_round(tiny_chat, tmp_path):
    model, tok = tiny_chat
    out = regenerate(model, tok, CONVS[:2], tmp_path / "r.jsonl", cfg(turns=2, temperature=0.0))
    for cid, turns in out:
        assert [t["role"] for t in turns] == ["user", "assistant", "user", "assistant"]
        assert turns[0]["content"] == "what is the cat" and turns[1]["content"] != "one two"
    one = regenerate(model, tok, CONVS[:2], tmp_path / "one.jsonl", cfg(turns=1))
    assert [len(t) for _, t in one] == [2, 2] and one[0][1][1] == out[0][1][1]  # greedy: same first answer


def test_a_killed_run_resumes_without_duplicates_or_losses(tiny_chat, tmp_path, monkeypatch):
    model, tok = tiny_chat
    reference = regenerate(model, tok, CONVS, tmp_path / "ref.jsonl", cfg(temperature=0.8))

    calls = {"n": 0}
    real = regen.generate_batch

    def dying(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:  # killed while the second batch runs
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(regen, "generate_batch", dying)
    path = tmp_path / "run.jsonl"
    with pytest.raises(KeyboardInterrupt):
        regenerate(model, tok, CONVS, path, cfg(temperature=0.8))
    monkeypatch.setattr(regen, "generate_batch", real)
    assert len(read_done(path)) == 3
    with open(path, "a") as f:
        f.write('{"id": "c3", "turns": [')  # a write cut by the kill
    resumed = regenerate(model, tok, CONVS, path, cfg(temperature=0.8))
    assert resumed == reference  # sampling is seeded per batch: the same rows as an uninterrupted run
    ids = [json.loads(line)["id"] for line in path.read_text().splitlines()]
    assert sorted(ids) == sorted(c for c, _ in CONVS) and len(ids) == len(set(ids))


def test_config_is_validated():
    with pytest.raises(ValueError):
        RegenerateConfig(turns=0)
    with pytest.raises(ValueError):
        RegenerateConfig(top_p=0.0)
    with pytest.raises(ValueError, match="regenerate.weight_layout='diagonal'"):
        RegenerateConfig(weight_layout="diagonal")


@pytest.mark.skipif(not packing_available(), reason="this PyTorch build has no MKL packed product")
def test_the_hf_backend_decodes_in_its_weight_layout(tiny_chat):
    """hf_load sets regenerate.weight_layout on the shared target; packed answers are the row answers."""
    model, tok = tiny_chat
    prompts = [turns[:1] for _, turns in CONVS[:4]]  # 4 rows a step: the packed product's range
    plain = regen.generate_batch(model, tok, prompts, cfg(), seed=0)
    twin = copy.deepcopy(model)
    assert regen.hf_load(None, cfg(weight_layout="packed"), None, lambda: twin) is twin
    assert regen.generate_batch(twin, tok, prompts, cfg(), seed=0) == plain
    packed = [m for m in twin.modules() if type(m) is PackedLinear]
    assert packed and all(m._pack is not None for m in packed)  # every linear took the packed product


def test_shrinking_decoder_matches_generate_and_drops_finished_rows(tiny_chat):
    import torch

    model, tok = tiny_chat
    tok.padding_side = "left"
    texts = ["the cat sat on the mat", "why", "what is the dog and the red cat"]
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    hf = model.generate(
        **enc, max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id, eos_token_id=None
    )
    hf = hf[:, enc["input_ids"].shape[1] :].tolist()
    stop = hf[0][2]  # row 0 stops at its third token; the others run on unless they emit it too
    rows = regen.decode_shrinking(
        model,
        enc["input_ids"],
        enc["attention_mask"],
        RegenerateConfig(max_new_tokens=8),
        torch.tensor([stop]),
        seed=0,
    )
    for ours, theirs in zip(rows, hf):
        cut = theirs.index(stop) + 1 if stop in theirs else len(theirs)
        assert ours == theirs[:cut]
    assert len(rows[0]) == 3 and max(len(r) for r in rows) == 8
    sampled, again = (
        regen.decode_shrinking(
            model,
            enc["input_ids"],
            enc["attention_mask"],
            RegenerateConfig(max_new_tokens=8, temperature=0.9, top_p=0.8),
            torch.tensor([stop]),
            seed=5,
        )
        for _ in range(2)
    )
    assert sampled == again and sampled != rows  # seeded


def test_top_p_keeps_the_smallest_head_reaching_p():
    import torch

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    c = cfg(temperature=1.0, top_p=0.8)
    seen = {int(regen.next_tokens(logits, c, torch.Generator().manual_seed(s))) for s in range(200)}
    assert seen == {0, 1}


def test_reused_answers_are_matched_by_prompt_and_only_the_rest_is_regenerated(
    tiny_chat, tmp_path, monkeypatch
):
    model, tok = tiny_chat
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    old = regenerate(model, tok, CONVS[:3], earlier / "regenerated.jsonl", cfg())
    other = ("q0", [{"role": "user", "content": "a new question"}, {"role": "assistant", "content": "x"}])
    # the same prompts under other ids (another corpus's naming), one prompt no earlier run answered
    convs = [(f"m{i}", turns) for i, (_, turns) in enumerate(CONVS[:3])] + [other]
    asked = []
    real = regen.generate_batch

    def counting(model, tok, prompts, *args, **kwargs):
        asked.extend(p[-1]["content"] for p in prompts)
        return real(model, tok, prompts, *args, **kwargs)

    monkeypatch.setattr(regen, "generate_batch", counting)
    path = tmp_path / "run.jsonl"
    out = regenerate(
        model, tok, convs, path, cfg(reuse=[str(earlier)])
    )  # a folder means its regenerated.jsonl
    assert asked == ["a new question"]
    assert [t for _, t in out[:3]] == [t for _, t in old] and [c for c, _ in out] == ["m0", "m1", "m2", "q0"]
    assert list(read_done(path)) == ["m0", "m1", "m2", "q0"]  # the folder holds every row: self-contained
    asked.clear()
    assert regenerate(model, tok, convs, path, cfg(reuse=[str(earlier)])) == out and asked == []  # rerun
    # two kept rounds: the earlier one-round rows are another prompt, so nothing is reused
    two = regenerate(model, tok, convs[:1], tmp_path / "two.jsonl", cfg(turns=2, reuse=[str(earlier)]))
    assert asked == ["what is the cat", "why"] and len(two[0][1]) == 4


def test_a_missing_reuse_file_is_named(tiny_chat, tmp_path):
    model, tok = tiny_chat
    with pytest.raises(FileNotFoundError, match="no regenerated answers at .*/nowhere$"):
        regenerate(model, tok, CONVS[:1], tmp_path / "r.jsonl", cfg(reuse=[str(tmp_path / "nowhere")]))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="empty/regenerated.jsonl"):
        regenerate(model, tok, CONVS[:1], tmp_path / "r.jsonl", cfg(reuse=[str(tmp_path / "empty")]))
