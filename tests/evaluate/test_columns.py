"""Verification over the draft vocabulary's columns (evaluate/decoding/columns.py): with a draft vocabulary
smaller than the target's, the law of whole generations through the real loop is the target's, by exact
enumeration, for every sampled verifier; a wrong draw inside the rest column is caught."""

from __future__ import annotations

import pytest
import torch

from specblock.evaluate.decoding import columns as columns_mod
from specblock.evaluate.decoding.columns import DraftColumns
from specblock.evaluate.decoding.loop import DecodeConfig, SpeculativeDecoder
from specblock.train.drafters import build_drafter
from specblock.train.modeling.eagle3 import Eagle3Config
from specblock.train.modeling.specblock import SpecBlockConfig

from tiny_decoding import PROMPT, OracleRoot, exact_law, loop_law, max_error, near_target_law, tiny_target

V = 24
REST = [5, 12, 18, 23]  # target ids outside the draft vocabulary; 12 and 23 are likely under the target
D2T = [t for t in range(V) if t not in REST]  # 20 ids (SpecBlock's rank features need 20)
HORIZON = 2


def small_vocab_drafter(target, name: str) -> torch.nn.Module:
    torch.manual_seed(4)
    m = target.model
    emb, head = m.get_input_embeddings().weight, m.get_output_embeddings().weight
    d2t = torch.tensor(D2T)
    if name == "specblock":
        cfg = SpecBlockConfig(block_size=2, num_layers=1, rank_hidden=8, draft_vocab_size=len(D2T))
    else:
        cfg = Eagle3Config(ttt_length=2, draft_vocab_size=len(D2T))
    return build_drafter(name, cfg, m.config, emb, head * 0.5, d2t).eval()


@pytest.fixture
def setup():  # function scope: its patch of the drafting code must not outlive its test
    """conftest.py's exact setup (a 24-token target whose top-p 0.5 law leaves 38 three-token sequences,
    a draft law near the target's), two new tokens, and a draft vocabulary that misses 4 ids, which the
    target's two-token sequences hold with probability > 0.5."""
    target = tiny_target(V, 12.0, seed=2)
    ref = exact_law(target, 1.0, 0.5, horizon=HORIZON)
    rest = sum(w for seq, w in ref.items() if set(seq) & set(REST))
    assert rest > 0.5  # the rest column is drawn often: the case this file is about
    patch = OracleRoot(near_target_law(target, D2T), len(PROMPT))
    yield target, ref
    patch.uninstall()


@pytest.mark.parametrize(
    "drafter,mode,verifier,k,length",
    [
        ("eagle3", "chain", "token", 1, 2),
        ("specblock", "chain", "greedy_block", 1, 2),  # a continuation in force for the second token
        ("eagle3", "iid", "spectr", 2, 1),
        ("specblock", "iid", "rrs", 2, 1),
        ("eagle3", "iid", "spectr_gbv", 2, 2),  # 811 outcomes: the slowest here (~9 s)
    ],
)
def test_generations_keep_the_target_law_with_a_smaller_draft_vocabulary(
    setup, drafter, mode, verifier, k, length
):
    target, ref = setup
    cfg = DecodeConfig(mode, verifier, k, length, 1.0, 0.5, max_new_tokens=HORIZON)
    module = small_vocab_drafter(target, drafter)
    dec = SpeculativeDecoder(target, module, cfg)
    assert dec.columns is not None and dec.columns.other == len(D2T)
    assert max_error(loop_law(target, module, cfg), ref) < 1e-6


def test_a_wrong_draw_in_the_rest_column_is_caught(setup, monkeypatch):
    """The negative control: drawing the rest token uniformly instead of from q restricted to the rest."""
    target, ref = setup

    def uniform(self, col, law, sampler):
        if col != self.other:
            return self.ids[col]
        return int(sampler.categorical(self.rest.to(law.dtype)))

    monkeypatch.setattr(columns_mod.DraftColumns, "token", uniform)
    cfg = DecodeConfig("chain", "token", 1, 2, 1.0, 0.5, max_new_tokens=HORIZON)
    assert max_error(loop_law(target, small_vocab_drafter(target, "eagle3"), cfg), ref) > 1e-3


def test_columns_keep_the_mass_and_map_tokens():
    cols = DraftColumns(torch.tensor([0, 3, 4]), 6)  # 1, 2 and 5 are the rest
    laws = torch.softmax(torch.randn(5, 6, generator=torch.Generator().manual_seed(0)), -1)
    rows = cols.target(laws)
    assert rows.shape == (5, 4)
    torch.testing.assert_close(rows.sum(-1), torch.ones(5))
    torch.testing.assert_close(rows[:, :3], laws[:, [0, 3, 4]])
    torch.testing.assert_close(rows[:, 3], laws[:, [1, 2, 5]].sum(-1))
    assert cols.cols([4, 1, 3, 5]) == (2, 3, 1, 3)
    assert cols.ids_of((2, 0, 1)) == (4, 0, 3) and cols.ids_of((0, 3)) is None
    assert cols.token(1, laws[0], sampler=None) == 3


def test_sampled_drafts_are_verified_over_columns_and_temperature_zero_is_not(setup):
    target, _ = setup
    drafter = small_vocab_drafter(target, "eagle3")
    sampled = SpeculativeDecoder(target, drafter, DecodeConfig("iid", "spectr", 2, 2, 0.7))
    greedy = SpeculativeDecoder(target, drafter, DecodeConfig("iid", "spectr", 2, 2, 0.0))
    assert sampled.columns is not None and greedy.columns is None
    g = sampled.generate(PROMPT, seed=1)
    assert len(g.tokens) == 64 and set(g.tokens) <= set(range(V))
