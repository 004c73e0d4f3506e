"""The longest-first order of a persistent decode launch (mlaserve.kernels.triton.work_order), through
Triton's CPU interpreter here, against torch's stable descending sort."""

import pytest
import torch

from mlaserve.kernels.triton.work_order import longest_first


@pytest.mark.parametrize("b, high", [(1, 10), (7, 3), (128, 5000), (300, 40), (513, 2)])
def test_longest_first_is_a_stable_descending_sort(b, high):
    gen = torch.Generator().manual_seed(b)
    lens = torch.randint(0, high, (b,), generator=gen, dtype=torch.int32)
    want = torch.sort(lens, descending=True, stable=True).indices.to(torch.int32)
    got = longest_first(lens)
    assert got.dtype == torch.int32 and torch.equal(got, want)


def test_equal_lengths_keep_batch_order():
    assert torch.equal(longest_first(torch.full((200,), 4096, dtype=torch.int32)),
                       torch.arange(200, dtype=torch.int32))


def test_writes_into_a_given_buffer_and_rejects_bad_input():
    out = torch.full((3,), -1, dtype=torch.int32)
    assert longest_first(torch.tensor([1, 9, 5], dtype=torch.int32), out=out) is out
    assert out.tolist() == [1, 2, 0]
    assert longest_first(torch.empty(0, dtype=torch.int32)).shape == (0,)
    with pytest.raises(ValueError, match="int32"):
        longest_first(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match=r"int32 \[3\]"):
        longest_first(torch.tensor([1, 9, 5], dtype=torch.int32), out=torch.empty(4, dtype=torch.int32))
