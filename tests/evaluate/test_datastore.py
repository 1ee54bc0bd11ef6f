"""lookup's datastore of the target's answers: its table against a direct count on random answers, its rules
on hand-made ones, reading a data folder's answers and refusing another tokenizer's, and lookup with it
through the real loop (greedy equality, the exact law of whole generations)."""

from __future__ import annotations

import collections
import random

import pytest

from specblock.data.manifest import Manifest
from specblock.data.shards import write_token_shards
from specblock.evaluate.decoding.datastore import Datastore, answers, check_tokenizer, load_datastore
from specblock.evaluate.decoding.loop import DecodeConfig, SpeculativeDecoder
from specblock.evaluate.decoding.lookup import LookupConfig, LookupSession
from specblock.evaluate.decoding.trees import TreeConfig

from tiny_decoding import HORIZON, PROMPT, REPEATS, VOCAB, exact_law, loop_law, max_error, tiny_target


def direct(seqs: list[list[int]], n: int, length: int) -> dict[tuple, list[int]]:
    """The rule by counting: per n-gram with a successor, its most frequent continuation of up to `length`
    tokens within the same answer, ties to the one that occurs first."""
    counts: dict[tuple, collections.Counter] = collections.defaultdict(collections.Counter)
    first: dict[tuple, int] = {}
    pos = 0
    for s in seqs:
        for j in range(len(s) - n):
            gram, cont = tuple(s[j : j + n]), tuple(s[j + n : j + n + length])
            counts[gram][cont] += 1
            first.setdefault((gram, cont), pos + j)
        pos += len(s) + length
    return {g: list(min(c, key=lambda x: (-c[x], first[(g, x)]))) for g, c in counts.items()}


def test_table_equals_a_direct_count_on_random_answers():
    rng = random.Random(0)
    for trial in range(20):
        vocab = rng.choice([3, 5, 40])  # few ids: many repeated n-grams and ties
        seqs = [
            [rng.randrange(vocab) for _ in range(rng.randrange(2, 30))] for _ in range(rng.randrange(1, 12))
        ]
        length = rng.choice([1, 3, 5])
        store = Datastore.build(seqs, 3, 1, length)
        for n in (1, 2, 3):
            ref = direct(seqs, n, length)
            keys, _ = store.tables[n]
            assert len(keys) == len(ref)
            for gram, cont in ref.items():
                context = [rng.randrange(vocab) for _ in range(rng.randrange(3))] + list(gram)
                # the longest order first: ask the table of order n alone
                got = Datastore({n: store.tables[n]}, store.bits, store.length, 0).draft(context, length)
                assert got == (n, cont), (trial, gram)


def test_longest_ngram_wins_and_a_draft_stops_at_an_answer_end():
    store = Datastore.build([[1, 2, 3, 4], [9, 2, 3, 7, 8], [5, 3, 6]], 2, 1, 4)
    assert store.draft([2, 3], 4) == (2, [4])  # "2 3" -> 4 first (tie with 7 8, which occurs later)
    assert store.draft([5, 3], 4) == (2, [6])  # not "2 3 ..." nor the next answer's tokens
    assert store.draft([0, 3], 4) == (1, [4])  # no 2-gram "0 3": the 1-gram "3", its first continuation
    assert store.draft([0, 3], 1) == (1, [4])
    assert store.draft([8], 4) == (0, [])  # 8 ends an answer: no successor
    assert store.draft([10**6], 4) == (0, []) and store.draft([], 4) == (0, [])


def test_most_frequent_continuation_wins():
    store = Datastore.build([[1, 2, 5], [1, 2, 6, 0], [3, 1, 2, 6, 0]], 2, 2, 2)
    assert store.draft([1, 2], 2) == (2, [6, 0])  # "6 0" twice against "5" (cut by its answer's end) once
    assert store.draft([1, 2], 1) == (2, [6])


def test_ngrams_that_do_not_fit_64_bits_are_refused():
    with pytest.raises(ValueError, match="only up to n = 3"):
        Datastore.build([[0, 2**17 - 1, 3]], 4, 2, 4)


def token_folder(tmp_path, rows, tokenizer_hash="tiny-tokenizer"):
    manifest = Manifest(
        kind="tokens", target_id="tiny", tokenizer_hash=tokenizer_hash, max_length=64, dtype="int32"
    )
    return write_token_shards(rows, tmp_path / "data" / "tokens", manifest, shard_rows=2)


def row(prompt: list[int], answer: list[int], more: list[int] = ()) -> dict:
    """A chat row: prompt tokens (mask 0), an answer (mask 1), and optionally a user turn and a second answer."""
    ids = prompt + answer + list(more)
    mask = [0] * len(prompt) + [1] * len(answer) + [0] * (len(more) // 2) + [1] * (len(more) - len(more) // 2)
    return {"input_ids": ids, "loss_mask": mask}


def test_answers_are_the_masked_spans_of_every_row(tmp_path):
    token_folder(tmp_path, [row([7, 7], [1, 2, 3]), row([8], [4, 5], [9, 9, 6, 6]), row([1], [2, 2])])
    got = [a.tolist() for a in answers(tmp_path / "data")]  # a data folder or its tokens/ folder
    assert got == [[1, 2, 3], [4, 5], [6, 6], [2, 2]]
    assert [a.tolist() for a in answers(tmp_path / "data" / "tokens")] == got


def test_a_datastore_of_another_tokenizer_is_refused(tmp_path):
    token_folder(tmp_path, [row([7], [1, 2, 3])], tokenizer_hash="abc")
    check_tokenizer(tmp_path / "data", "abc")
    with pytest.raises(
        ValueError,
        match=r"tokens/manifest.json does not match[^']*tokenizer_hash: expected 'def' vs found 'abc'",
    ):
        check_tokenizer(tmp_path / "data", "def")


def test_lookup_drafts_from_the_datastore_only_where_the_context_has_no_match(tmp_path):
    token_folder(tmp_path, [row([0], [4, 5, 6, 7, 8]), row([0], [5, 6, 9])])
    session = LookupSession(LookupConfig(datastore=str(tmp_path / "data")), 3)
    assert session.draft([1, 2, 4, 5]) == [6, 7, 8] and session.matched == -2  # the datastore's "4 5"
    session.reset()
    assert session.draft([5, 3, 5]) == [3, 5] and session.matched == 1  # the context's own "5" first
    session.reset()
    assert session.draft([1, 2]) == [] and session.matched == 0


# ---------------------------------------------------------------- through the real loop


def greedy_answers(target, prompts: list[list[int]], n: int) -> list[dict]:
    """Rows whose answers are the target's greedy continuations: a datastore that drafts what it says."""
    cfg = DecodeConfig(mode="autoregressive", temperature=0.0, max_new_tokens=n)
    rows = []
    for p in prompts:
        out = SpeculativeDecoder(target, None, cfg).generate(p).tokens
        rows.append(row(p[:2], p[2:] + out))
    return rows


def test_lookup_with_a_datastore_equals_target_greedy(greedy_setup, tmp_path):
    target, _ = greedy_setup
    rng = random.Random(1)
    prompts = [[rng.randrange(64) for _ in range(4)] for _ in range(6)]
    token_folder(
        tmp_path, greedy_answers(target, prompts, 16) + [row([0], [rng.randrange(64) for _ in range(40)])]
    )
    lookup = LookupConfig(datastore=str(tmp_path / "data"))
    ar = DecodeConfig(mode="autoregressive", temperature=0.0, max_new_tokens=20)
    cfg = DecodeConfig("lookup", draft_length=4, temperature=0.0, max_new_tokens=20, lookup=lookup)
    accepted = 0
    for p in prompts + [[5, 6, 7]]:
        ref = SpeculativeDecoder(target, None, ar).generate(p)
        out = SpeculativeDecoder(target, None, cfg).generate(p)
        assert out.tokens == ref.tokens
        accepted += sum(it.accepted for it in out.iterations)
    assert accepted >= 10  # the datastore's continuations were drafted and accepted


def test_tree_lookup_drafts_the_datastore_only_instead_of_a_plain_step(greedy_setup, tmp_path, monkeypatch):
    """tree+lookup with budget=auto: where the gate would take a plain step (no context match, the drafter
    not called) the datastore's chain is verified instead; beside the drafter no datastore chain is offered.
    The gate is patched to skip the drafter exactly where the context has no match."""
    target, ds = greedy_setup
    rng = random.Random(3)
    prompts = [[rng.randrange(64) for _ in range(4)] for _ in range(4)]
    token_folder(tmp_path, greedy_answers(target, prompts, 16))
    tree = TreeConfig(budget="auto", max_budget=6, steps=1, beam=2, topk=2)
    lookup = LookupConfig(datastore=str(tmp_path / "data"))
    cfg = DecodeConfig(
        "tree+lookup", draft_length=4, temperature=0.0, max_new_tokens=16, tree=tree, lookup=lookup
    )
    ar = DecodeConfig(mode="autoregressive", temperature=0.0, max_new_tokens=16)
    from_datastore, beside = 0, []  # beside: what the chain followed where the drafter ran
    for p in prompts + [REPEATS]:  # REPEATS: context matches, so the drafter runs too
        dec = SpeculativeDecoder(target, ds["specblock"], cfg)
        monkeypatch.setattr(dec.auto, "lookup_alone", lambda n, ngram=0: 0 if n == 0 else None)
        offered, inner = [], dec.graft.fallback
        monkeypatch.setattr(
            dec.graft, "fallback", lambda context: offered.append(inner(context)) or offered[-1]
        )
        catch_up = dec.graft.catch_up
        monkeypatch.setattr(
            dec.graft, "catch_up", lambda s, g=dec.graft: beside.append(g.ngram) or catch_up(s)
        )
        out = dec.generate(p)
        assert out.tokens == SpeculativeDecoder(target, None, ar).generate(p).tokens
        drafterless = [it for it in out.iterations if it.drafter_calls == 0]
        assert len(offered) == len(drafterless)  # asked exactly where the drafter was left out
        from_datastore += sum(it.accepted for it in drafterless)
    assert from_datastore >= 8  # the datastore's greedy continuations, accepted without the drafter
    assert (
        beside and min(beside) >= 0
    )  # a context chain or none beside the drafter, never a datastore's (< 0)


@pytest.mark.parametrize("temperature,top_p", [(1.0, 0.5), (0.7, 0.5)])
def test_exact_law_of_lookup_with_a_datastore(tmp_path, temperature, top_p):
    """PROMPT repeats no token, so the first draft comes from the datastore, which holds the target's
    greedy continuation of it: the law of three generated tokens equals the target's, with drafts accepted."""
    target = tiny_target(VOCAB, 12.0, seed=2)
    rng = random.Random(2)
    noise = [row([0], [rng.randrange(VOCAB) for _ in range(30)]) for _ in range(3)]
    token_folder(tmp_path, greedy_answers(target, [PROMPT], 4) + noise)
    load_datastore.cache_clear()
    cfg = DecodeConfig(
        "lookup", draft_length=2, temperature=temperature, top_p=top_p, max_new_tokens=HORIZON,
        lookup=LookupConfig(datastore=str(tmp_path / "data")),
    )  # fmt: skip
    ref, accepted = exact_law(target, temperature, top_p, PROMPT), []
    law = loop_law(target, None, cfg, prompt=PROMPT, accepted=accepted)
    assert max_error(law, ref) < 1e-6
    assert sum(accepted) > 0.1
    # without the datastore the same prompt drafts nothing at first: fewer accepted drafts
    plain, few = (
        DecodeConfig("lookup", draft_length=2, temperature=temperature, top_p=top_p, max_new_tokens=HORIZON),
        [],
    )
    loop_law(target, None, plain, prompt=PROMPT, accepted=few)
    assert sum(few) < sum(accepted)
