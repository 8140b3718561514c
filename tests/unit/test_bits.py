import numpy as np
import pytest
import torch

from trimlab.codec import bits


@pytest.mark.parametrize("k", range(1, 17))
def test_planes_match_numpy_packbits(k):
    q = torch.randint(0, 1 << k, (7, 96), generator=torch.Generator().manual_seed(k))
    planes = bits.pack_planes(q, k)
    qn = q.numpy()
    ref = np.stack([np.packbits(((qn >> (k - 1 - j)) & 1).astype(np.uint8), axis=1)
                    for j in range(k)], axis=1)
    assert planes.shape == (7, k, 12)
    np.testing.assert_array_equal(planes.numpy(), ref)
    assert torch.equal(bits.unpack_planes(planes, k), q.to(torch.int32))


def test_pack31_is_a_contiguous_bit_string():
    v = torch.randint(0, 1 << 31, (3, 64), generator=torch.Generator().manual_seed(1))
    words = bits.pack31(v)
    assert words.shape == (3, 62) and words.dtype == torch.int32
    for row in range(3):
        want = "".join(format(int(x), "031b") for x in v[row])
        got = "".join(format(int(x) & 0xFFFFFFFF, "032b") for x in words[row])
        assert got == want
    assert torch.equal(bits.unpack31(words), v.to(torch.int32))


def test_words_bytes_roundtrip():
    w = torch.tensor([[0, 1, -1, -(1 << 31), 0x12345678]], dtype=torch.int32)
    b = bits.words_to_bytes(w)
    assert b.shape == (1, 20)
    assert b[0, 16:].tolist() == [0x78, 0x56, 0x34, 0x12]  # little-endian
    assert torch.equal(bits.bytes_to_words(b), w)
