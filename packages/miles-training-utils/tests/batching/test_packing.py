"""Sequence packing: next-token loss alignment per document, position restarts, no cross-document
attention, and the per-document unpacking of per-position values."""

import itertools

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from miles.backends.training_utils.batching.packing import (
    PAD_TOKEN_ID,
    attention_mask_from_cu_seqlens,
    pack_sequences,
    unpack_per_token,
)


@st.composite
def documents(draw):
    """(token_lists, response_lengths, loss_masks, pad_to_multiple) for 0..6 documents."""
    tokens, responses, masks = [], [], []
    for _ in range(draw(st.integers(0, 6))):
        prompt_len = draw(st.integers(1, 8))
        response_len = draw(st.integers(0, 8))
        ids = st.integers(1, 1000)  # never PAD_TOKEN_ID, so padding is recognisable
        tokens.append(
            draw(
                st.lists(
                    ids, min_size=prompt_len + response_len, max_size=prompt_len + response_len
                )
            )
        )
        responses.append(response_len)
        masks.append(
            draw(st.lists(st.integers(0, 1), min_size=response_len, max_size=response_len))
        )
    return tokens, responses, masks, draw(st.integers(1, 8))


def _reference_loss_mask(tokens, responses, masks, total):
    """Per document: position t is trained iff token t + 1 is a masked-in response token of it."""
    out = []
    for doc, n_resp, mask in zip(tokens, responses, masks, strict=True):
        trainable = [0] * (len(doc) - n_resp) + list(mask)  # per token of the document
        out += [*trainable[1:], 0]  # shift to the predicting position; the last predicts nothing
    return out + [0] * (total - len(out))


@settings(max_examples=100, deadline=None)
@given(case=documents())
def test_packed_loss_mask_matches_a_per_document_next_token_reference(case):
    tokens, responses, masks, pad = case
    packed = pack_sequences(tokens, responses, masks, pad_to_multiple=pad)
    total = packed.total_length
    assert total % pad == 0 and 0 <= total - sum(map(len, tokens)) < pad
    assert packed.loss_mask.shape == (1, total) and packed.loss_mask.dtype == torch.float32
    assert packed.loss_mask[0].tolist() == _reference_loss_mask(tokens, responses, masks, total)


@settings(max_examples=100, deadline=None)
@given(case=documents())
def test_position_ids_restart_at_zero_for_every_document(case):
    tokens, responses, masks, pad = case
    packed = pack_sequences(tokens, responses, masks, pad_to_multiple=pad)
    expected = [t for doc in tokens for t in range(len(doc))]
    expected += list(range(packed.total_length - len(expected)))  # padding: its own segment
    assert packed.position_ids.shape == (1, packed.total_length)
    assert packed.position_ids[0].tolist() == expected


@settings(max_examples=100, deadline=None)
@given(case=documents())
def test_input_ids_and_cu_seqlens_lay_documents_end_to_end_then_pad(case):
    tokens, responses, masks, pad = case
    packed = pack_sequences(tokens, responses, masks, pad_to_multiple=pad)
    flat = [t for doc in tokens for t in doc]
    assert packed.input_ids.dtype == torch.long
    assert packed.input_ids[0].tolist() == flat + [PAD_TOKEN_ID] * (packed.total_length - len(flat))
    bounds = [0]
    for doc in tokens:
        bounds.append(bounds[-1] + len(doc))
    assert packed.cu_seqlens.dtype == torch.int32 and packed.cu_seqlens.tolist() == bounds
    assert packed.cu_seqlens_with_padding[-1] == packed.total_length
    assert packed.max_seqlen == max([len(d) for d in tokens] + [packed.num_pad_tokens])


@settings(max_examples=100, deadline=None)
@given(case=documents())
def test_unpacked_next_token_values_are_each_documents_response_tokens(case):
    tokens, responses, masks, pad = case
    packed = pack_sequences(tokens, responses, masks, pad_to_multiple=pad)
    # At position t put the id of token t + 1: what the logits at t are scored against.
    next_token = torch.roll(packed.input_ids[0], shifts=-1)  # (T,)
    per_doc = unpack_per_token(next_token, packed)
    for doc, n_resp, mask, values, (begin, end) in zip(
        tokens, responses, masks, per_doc, packed.response_slices, strict=True
    ):
        assert values.tolist() == doc[len(doc) - n_resp :]
        assert packed.loss_mask[0, begin:end].tolist() == mask


def test_a_small_example_by_hand():
    packed = pack_sequences(
        [[11, 12, 13, 14], [21, 22, 23]], [2, 1], [[1, 0], [1]], pad_to_multiple=4
    )
    assert packed.input_ids.tolist() == [[11, 12, 13, 14, 21, 22, 23, 0]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 0]]
    # 12 predicts 13 (trained), 13 predicts 14 (masked out), 22 predicts 23 (trained).
    assert packed.loss_mask.tolist() == [[0, 1, 0, 0, 0, 1, 0, 0]]
    assert packed.response_slices == [(1, 3), (5, 6)]
    assert packed.cu_seqlens_with_padding.tolist() == [0, 4, 7, 8]


@st.composite
def cu_seqlens_and_total(draw):
    lengths = draw(st.lists(st.integers(0, 6), max_size=6))
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    return torch.tensor(bounds, dtype=torch.int32), bounds[-1] + draw(st.integers(0, 4))


@settings(max_examples=100, deadline=None)
@given(case=cu_seqlens_and_total())
def test_block_mask_lets_a_token_see_exactly_the_earlier_tokens_of_its_own_document(case):
    cu_seqlens, total = case
    bounds = cu_seqlens.tolist()
    doc_of = [None] * total  # None: padding, which is no document
    for d in range(len(bounds) - 1):
        for t in range(bounds[d], bounds[d + 1]):
            doc_of[t] = d
    mask = attention_mask_from_cu_seqlens(cu_seqlens, total)
    assert mask.shape == (total, total) and mask.dtype == torch.bool
    for q in range(total):
        assert mask[q, q], "every row keeps itself, so softmax never sees an empty row"
        for k in range(total):
            if doc_of[q] is not None or doc_of[k] is not None:
                assert bool(mask[q, k]) == (doc_of[q] == doc_of[k] and k <= q)
            else:  # padding with padding: causal within the trailing segment
                assert bool(mask[q, k]) == (k <= q)


@settings(max_examples=30, deadline=None)
@given(case=documents(), seed=st.integers(0, 2**16))
def test_masked_sdpa_on_the_packed_row_equals_attention_on_each_document_alone(case, seed):
    tokens, responses, masks, pad = case
    packed = pack_sequences(tokens, responses, masks, pad_to_multiple=pad)
    total = packed.total_length
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (
        torch.randn(1, 2, total, 4, generator=gen, dtype=torch.float64) for _ in range(3)
    )  # (B, H, T, D)
    mask = attention_mask_from_cu_seqlens(packed.cu_seqlens, total)
    packed_out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (1, 2, T, 4)
    assert torch.isfinite(packed_out).all()
    bounds = packed.cu_seqlens.tolist()
    for start, end in itertools.pairwise(bounds):
        alone = F.scaled_dot_product_attention(
            q[:, :, start:end], k[:, :, start:end], v[:, :, start:end], is_causal=True
        )
        torch.testing.assert_close(packed_out[:, :, start:end], alone)


def test_a_document_without_prompt_tokens_is_rejected():
    with pytest.raises(
        ValueError,
        match=r"document 1: response length 2 must be in \[0, 2\) .* at least one prompt token",
    ):
        pack_sequences([[1, 2], [3, 4]], [1, 2], [[1], [1, 1]])


def test_a_loss_mask_of_the_wrong_length_is_rejected():
    with pytest.raises(
        ValueError, match=r"document 0: loss mask has 1 entries for 2 response tokens"
    ):
        pack_sequences([[1, 2, 3]], [2], [[1]])


def test_mismatched_document_lists_are_rejected():
    with pytest.raises(ValueError, match=r"got 2 token lists, 1 response lengths and 2 loss masks"):
        pack_sequences([[1, 2], [3, 4]], [1], [[1], [1]])


def test_pad_to_multiple_below_one_is_rejected():
    with pytest.raises(ValueError, match=r"pad_to_multiple must be at least 1, got 0"):
        pack_sequences([[1, 2]], [1], [[1]], pad_to_multiple=0)


def test_unpack_rejects_values_of_the_wrong_length():
    packed = pack_sequences([[1, 2, 3]], [1], [[1]], pad_to_multiple=4)
    assert [t.tolist() for t in unpack_per_token(torch.arange(4).unsqueeze(0), packed)] == [[1]]
    with pytest.raises(ValueError, match=r"shape \(T,\) or \(1, T\) with T=4 .* got \(3,\)"):
        unpack_per_token(torch.zeros(3), packed)


def test_block_mask_rejects_cu_seqlens_past_the_total_length():
    with pytest.raises(ValueError, match=r"end at or before total_length \(3\)"):
        attention_mask_from_cu_seqlens(torch.tensor([0, 2, 5], dtype=torch.int32), 3)
    with pytest.raises(ValueError, match=r"must be 1-D and start at 0"):
        attention_mask_from_cu_seqlens(torch.tensor([1, 2], dtype=torch.int32), 3)
