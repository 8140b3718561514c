import math

import torch

from trimlab.codec import rht

# Golden vector: sign bits (1 = negate, coordinate 0 first) of spans 4 and 5 of
# (seed=1, step=2, bucket=3), n = 64. Must never change: every host decodes with them.
GOLDEN_SIGNS = {4: 0x3FB83540770BBFEF, 5: 0x9726CDCDC3EEA457}
GOLDEN_KEY = 0xD55CCD4AEB3CCAFB
GOLDEN_ROTATED = [0.22036, -0.086722, 0.03188, 0.429198, -0.600348, 0.154546, -0.512094, 0.766685]


def _bits(signs):
    return int("".join("1" if s < 0 else "0" for s in signs.tolist()), 2)


def test_golden_signs_and_rotation():
    assert rht.span_key(1, 2, 3, 4) == GOLDEN_KEY
    signs = rht.span_signs(1, 2, 3, range(4, 6), 64)
    assert {4: _bits(signs[0]), 5: _bits(signs[1])} == GOLDEN_SIGNS
    x = torch.arange(64, dtype=torch.float32).sin()
    y = rht.rotate(x[None], rht.span_sign_masks(1, 2, 3, range(4, 5), 64))[0]
    assert torch.allclose(y[:8], torch.tensor(GOLDEN_ROTATED), atol=2e-6)


def test_signs_do_not_depend_on_batching_or_dtype():
    together = rht.span_signs(9, 8, 7, range(0, 10), 4096)
    one = rht.span_signs(9, 8, 7, range(6, 7), 4096, dtype=torch.float64)
    assert torch.equal(together[6].double(), one[0])


def test_signs_look_random():
    s = rht.span_signs(0, 0, 0, range(256), 4096)
    assert abs(float(s.mean())) < 5e-3
    assert abs(float((s[:, 1:] * s[:, :-1]).mean())) < 5e-3  # neighbours
    assert abs(float((s[1:] * s[:-1]).mean())) < 5e-3  # next span
    other_step = rht.span_signs(0, 1, 0, range(256), 4096)
    assert abs(float((s * other_step).mean())) < 5e-3


def test_hadamard_is_sylvester():
    h = rht.hadamard(8)
    for i in range(8):
        for j in range(8):
            assert h[i, j] == (-1) ** bin(i & j).count("1")


def test_fwht_matches_dense_hadamard():
    for m in range(0, 13):
        n = 1 << m
        x = torch.randn(3, n, dtype=torch.float64)
        assert torch.allclose(rht.fwht(x), x @ rht.hadamard(n, dtype=torch.float64), atol=1e-9)


def test_rotation_is_orthonormal_and_inverts():
    x = torch.randn(5, 4096, dtype=torch.float64)
    s = rht.span_sign_masks(1, 1, 1, range(5), 4096)
    y = rht.rotate(x, s)
    assert torch.allclose(rht.rotate(x.float(), s).double(), y, atol=1e-5)
    assert torch.allclose(y.norm(dim=1), x.norm(dim=1))
    assert torch.allclose(rht.unrotate(y, s), x, atol=1e-12)
    assert math.isclose(float(y.std()), float(x.std()), rel_tol=0.05)
