"""Where a codec defers its non-finite check to decode (its default off the CPU), the
strategies keep their contracts: compress_saved still keeps -inf masks exact, and an approx
boundary's error still says which argument of which block overflowed."""

import dataclasses

import pytest
import torch

from revckpt.approx import Approx, NonFiniteInputError
from revckpt.approx.formats import Codec
from revckpt.approx.recompute import Compressed
from revckpt.approx.saved import _SavedCodec


def _deferred(codec):
    return dataclasses.replace(codec, defer_checks=True)


def test_compress_saved_keeps_a_mask_exact_with_deferred_checks():
    hooks = _SavedCodec(_deferred(Codec("e4m3", "row")), min_numel=1, label="block 3")
    mask = torch.zeros(4, 8).masked_fill(torch.eye(4, 8, dtype=torch.bool), float("-inf"))
    packed = hooks.pack(mask)
    kept = hooks.unpack(packed)
    assert kept.data_ptr() == mask.data_ptr() and torch.equal(kept, mask)  # kept, not encoded


def test_compress_saved_still_refuses_an_overflowed_activation_at_decode():
    hooks = _SavedCodec(_deferred(Codec("e4m3", "row")), min_numel=1, label="block 3")
    act = torch.randn(4, 8, requires_grad=True) * 1  # an activation (not a leaf)
    with torch.no_grad():
        act[1, 2] = float("inf")
    packed = hooks.pack(act)
    assert not isinstance(packed, torch.Tensor)  # encoded: the check waits for decode
    with pytest.raises(NonFiniteInputError):
        hooks.unpack(packed)


def test_approx_boundary_error_names_the_argument_at_decode():
    keep = Compressed(Approx(store="e4m3"))
    keep.codec = _deferred(keep.codec)
    x = torch.randn(4, 8)
    x[0, 0] = float("nan")
    saved, recipe = keep.keep([x], "block 7 (Linear)")  # no error: checked at decode
    with pytest.raises(NonFiniteInputError, match=r"positional argument 0 of block 7 \(Linear\)"):
        keep.rebuild(saved, recipe)
