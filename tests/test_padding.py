"""SP-aligned padding of ragged text (single process)."""

from __future__ import annotations

import pytest
import torch

from sp_diffusers.parallel.padding import (
    PaddingError,
    pad_text_batch,
    pad_to_multiple,
    round_up,
    strip_padding,
)


def test_ragged_list_is_padded_to_batch_max_then_multiple():
    embeds = [torch.full((3, 2), 1.0), torch.full((5, 2), 2.0), torch.full((1, 2), 3.0)]
    dense, mask = pad_text_batch(embeds, multiple=4)
    assert dense.shape == (3, 8, 2) and mask.shape == (3, 8) and mask.dtype == torch.bool
    assert mask.sum(1).tolist() == [3, 5, 1]
    assert torch.equal(dense[1, :5], embeds[1]) and dense[1, 5:].abs().sum() == 0
    assert [t.shape[0] for t in strip_padding(dense, mask)] == [3, 5, 1]


def test_dense_input_with_mask_zeroes_padded_positions():
    embeds = torch.randn(2, 6, 4)
    mask = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1]])
    dense, m = pad_text_batch(embeds, mask, multiple=4)
    assert dense.shape == (2, 8, 4)
    assert dense[0, 3:].abs().sum() == 0 and torch.equal(dense[1, :6], embeds[1])
    assert m.tolist()[0] == [True] * 3 + [False] * 5


def test_already_aligned_is_unchanged():
    x = torch.randn(2, 8, 3)
    assert pad_to_multiple(x, 4) is x
    assert round_up(9, 4) == 12 and round_up(8, 4) == 8


def test_mask_and_embeddings_that_disagree_are_refused():
    with pytest.raises(PaddingError, match=r"prompt_embeds_mask shape \(2, 5\).*\(2, 6, 4\)"):
        pad_text_batch(torch.randn(2, 6, 4), torch.ones(2, 5), multiple=2)
    with pytest.raises(PaddingError, match="lengths"):
        pad_text_batch([torch.randn(3, 2)], [torch.ones(4, dtype=torch.bool)], multiple=2)
    with pytest.raises(PaddingError, match=r"\[B, L, D\]"):
        pad_text_batch(torch.randn(6, 4), multiple=2)
