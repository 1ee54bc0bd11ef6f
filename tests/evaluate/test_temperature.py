import pytest
import torch

from specblock.evaluate.decoding.temperature import next_token_law


def test_temperature_zero_is_argmax_with_first_index_on_ties():
    law = next_token_law(torch.tensor([[1.0, 3.0, 3.0, 0.0]]), temperature=0.0)
    assert law.tolist() == [[0.0, 1.0, 0.0, 0.0]]


def test_temperature_scales_the_softmax():
    logits = torch.tensor([0.0, 1.0, 2.0, 3.0])
    assert torch.allclose(next_token_law(logits, 0.5), torch.softmax(logits / 0.5, -1))
    assert torch.allclose(next_token_law(logits, 1.0), torch.softmax(logits, -1))


def test_top_p_keeps_the_smallest_nucleus_and_renormalises():
    probs = torch.tensor([0.1, 0.4, 0.3, 0.2])
    law = next_token_law(probs.log(), 1.0, top_p=0.65)  # 0.4 + 0.3 = 0.7 >= 0.65: tokens 1 and 2
    assert torch.allclose(law, torch.tensor([0.0, 0.4, 0.3, 0.0]) / 0.7)
    exact = next_token_law(probs.log(), 1.0, top_p=0.7)  # reaching top_p exactly stops there
    assert (exact > 0).tolist() == [False, True, True, False]
    assert torch.allclose(next_token_law(probs.log(), 1.0, top_p=1.0), probs)


def test_batched_and_bad_arguments():
    law = next_token_law(torch.randn(2, 3, 5), 0.7, 0.9)
    assert law.shape == (2, 3, 5) and torch.allclose(law.sum(-1), torch.ones(2, 3))
    with pytest.raises(ValueError):
        next_token_law(torch.randn(4), -1.0)
    with pytest.raises(ValueError):
        next_token_law(torch.randn(4), 1.0, top_p=0.0)
