"""``all_finite`` is exact: it finds every NaN/inf and is not fooled by sums that overflow."""

import pytest
import torch

from peers.core.finite import all_finite


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_finds_one_bad_value_anywhere(dtype: torch.dtype, bad: float) -> None:
    good = torch.randn(3, 5, dtype=dtype)
    assert all_finite([good, None])
    for index in (0, 7, 14):
        tensor = good.clone()
        tensor.view(-1)[index] = bad
        assert not all_finite([good, tensor]), (dtype, bad, index)


def test_inf_minus_inf_and_overflowing_sums() -> None:
    assert not all_finite([torch.tensor([float("inf"), -float("inf")])])  # the sum is NaN, as it must be
    huge = torch.full((16,), 3e38)  # finite values whose sum overflows: the exact check decides
    assert all_finite([huge])
    assert all_finite([torch.full((16,), 1e300, dtype=torch.float64)])  # its float32 sum is inf
    assert all_finite([]) and all_finite([None])
