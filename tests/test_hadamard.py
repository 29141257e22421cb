"""Block Walsh-Hadamard transform: orthogonal, exact inverse, equal to the dense definition."""

import pytest
import torch

from fp4train import hadamard
from fp4train.transforms import hadamard_matrix

BLOCKS = [2, 4, 16, 32, 64, 128, 256]


@pytest.mark.parametrize("b", BLOCKS)
def test_matrix_is_orthogonal_and_symmetric(b):
    H = hadamard_matrix(b, dtype=torch.float64)
    assert torch.allclose(H @ H.T, torch.eye(b, dtype=torch.float64), atol=1e-12)
    assert torch.equal(H, H.T)
    assert torch.allclose(H.abs(), torch.full_like(H, b**-0.5), rtol=1e-15, atol=0)


@pytest.mark.parametrize("b", BLOCKS)
def test_fast_transform_equals_dense_definition(b):
    x = torch.randn(6, 512, dtype=torch.float64)
    ref = (x.reshape(6, -1, b) @ hadamard_matrix(b, dtype=torch.float64)).reshape(6, 512)
    y = hadamard(x.float(), b).double()
    assert torch.allclose(y, ref, rtol=0, atol=1e-5 * ref.abs().max())


@pytest.mark.parametrize("b", BLOCKS)
@pytest.mark.parametrize("seed", [None, 3])
def test_inverse_is_exact_to_fp32_rounding(b, seed):
    x = torch.randn(8, 512)
    back = hadamard(hadamard(x, b, seed=seed), b, seed=seed, inverse=True)
    # two transforms of log2(b) butterfly stages each: a few ulp of the row's magnitude
    tol = 2 * (2 * torch.log2(torch.tensor(float(b))) + 2) * torch.finfo(torch.float32).eps
    assert ((back - x).abs() <= tol * x.abs().amax(-1, keepdim=True)).all()


def test_norm_is_preserved_and_outliers_are_spread():
    x = torch.zeros(1, 32)
    x[0, 5] = 32.0
    y = hadamard(x, 32)
    assert torch.allclose(y.norm(), x.norm())
    assert torch.allclose(y.abs(), torch.full_like(y, 32 / 32**0.5))


def test_inner_transform_leaves_gemm_unchanged():
    A, B = torch.randn(64, 128, dtype=torch.float64), torch.randn(32, 128, dtype=torch.float64)
    for seed in (None, 11):
        At, Bt = hadamard(A, 32, seed=seed), hadamard(B, 32, seed=seed)
        assert torch.allclose(At @ Bt.T, A @ B.T, atol=1e-10)


def test_axis_and_random_signs():
    x = torch.randn(64, 3, 5)
    assert torch.allclose(hadamard(x, 16, axis=0), hadamard(x.movedim(0, -1), 16).movedim(-1, 0))
    assert not torch.allclose(hadamard(x, 16, axis=0, seed=1), hadamard(x, 16, axis=0, seed=2))
    assert torch.equal(hadamard(x, 16, axis=0, seed=1), hadamard(x, 16, axis=0, seed=1))


def test_dtype_is_kept():
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    assert hadamard(x).dtype == torch.bfloat16
