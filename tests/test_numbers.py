"""revckpt._numbers: the shared relative error, bytes formatter and byte counts."""

import math

import torch

from revckpt._numbers import mib, relative, relative_error, storage_bytes, tensor_bytes


def test_relative_zeros_and_nan():
    assert relative(0.0, 0.0) == 0.0
    assert relative(0.0, 2.0) == 0.0
    assert relative(1.0, 0.0) == math.inf
    assert relative(1.0, 4.0) == 0.25
    assert math.isnan(relative(math.nan, 1.0))


def test_relative_error_of_lists_is_one_norm():
    a, b = torch.tensor([3.0, 0.0]), torch.tensor([0.0, 4.0])
    ref = [torch.ones(2), torch.ones(2)]
    got = [torch.ones(2) + a, torch.ones(2) + b]
    assert math.isclose(relative_error(got, ref), 5.0 / 2.0)
    assert relative_error(torch.zeros(3), torch.zeros(3)) == 0.0


def test_bytes():
    x = torch.zeros(4, 8)
    assert tensor_bytes(x[:2]) == 64 and storage_bytes(x[:2]) == 128
    assert mib(3 * 2**20) == "3.00 MiB" and mib(2**19, digits=3) == "0.500 MiB"
