"""The storage tracker's fast path (``_StorageTracker(fast=True)``, what ``MemoryMeter("cpu")``
runs) against its general path (``fast=False``: ``tree_flatten`` on every argument and result,
every argument's size read before and after): the same live bytes after every operation."""

import gc
import importlib.util
import json
import pathlib
import sys
from collections import namedtuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_flatten

from revckpt.measure.storages import _leaves, _StorageTracker, _tree_leaves


class Sub(torch.Tensor):
    """A tensor subclass with no behaviour of its own: the fast path hands it to tree_flatten."""


class OddNet(nn.Module):
    """Lists of tensors, views, in-place ops, results aliasing arguments, tensors freed
    mid-step, ``out=`` and ``resize_`` on tensors from before the block and from inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.lin = nn.Linear(16, 8)
        self.norm = nn.LayerNorm(8)
        self.emb = nn.Embedding(10, 8)

    def forward(self, x, pre, grow, ids):
        h = F.relu(self.bn(self.conv(x)))  # 4 x 4 x 4 x 4
        parts = list(h.unbind(1))  # views, a tuple result
        h = torch.cat([p * 2 for p in parts] + [h[:, 0].transpose(1, 2).transpose(1, 2)], dim=0)
        h = h.flatten(1)[:, :16]  # 20 x 16 view of a view
        h = self.norm(self.lin(h)) + self.emb(ids).sum(0)
        a, b = h.split([12, 8])
        tmp = torch.stack([a[:8], b, b.detach()], dim=0)  # freed below, mid-step
        h = torch.where(h > 0, h, h * 0.1) + tmp.mean()
        del tmp, a, b
        h.mul_(1.5).relu_()  # in place on a tensor made in the block
        pre.add_(1.0)  # in place on one from before: no new bytes
        torch.mul(pre, 2.0, out=grow)  # grows a tensor from before the block
        idx = torch.tensor([0, 2, 4])  # a lift op: made from Python data
        h = h[idx, :] + h[:, None][idx, 0] + torch.ops.aten.alias(pre.view_as(pre))[0, :8]
        h.index_put_((torch.tensor([0]),), torch.ones(8))  # a tuple of index tensors
        scratch = torch.empty(4)
        scratch.resize_(64)  # grows a storage made in the block
        scratch.resize_(2)  # shrinks it: the storage keeps its bytes
        torch._foreach_add_([scratch, pre[:2, :2].reshape(-1)], 1.0)
        s = scratch.as_subclass(Sub) * 3  # a subclass: the general path's tree_flatten
        s = s + pre.as_subclass(Sub)[1:, 0].sum()  # a view of a subclass from before
        values, where = torch.max(h, dim=1)  # a tuple result (a namedtuple in Python)
        sparse = h.detach().to_sparse() * 2  # no storage: not counted, not an error
        meta = torch.empty(5, device="meta")  # another device: not counted
        del sparse, meta
        return (h.sum() + values.sum() + s.sum() + where.float().sum()) * grow.mean()


class Recording(_StorageTracker):
    """The tracker, and its live and peak bytes after every operation."""

    def __init__(self, device_type, *, fast):
        super().__init__(device_type, fast=fast)
        self.trace = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        self.trace.append((str(func), self.live, self.peak))
        return out


def _trace(fast: bool) -> tuple[list, int, int, list]:
    torch.manual_seed(0)
    net = OddNet()
    x, ids = torch.randn(4, 3, 4, 4), torch.randint(0, 10, (5, 1))
    pre, grow = torch.randn(8, 8), torch.empty(0)
    tracker = Recording("cpu", fast=fast)
    trace = tracker.trace
    gc.collect()
    gc.disable()  # frees by reference count only: the same moments in both runs
    try:
        with tracker:
            loss = net(x, pre, grow, ids)
            loss.backward()
            del loss
            net.zero_grad(set_to_none=True)  # parameter gradients freed inside the block
            again = net(x, pre, grow, ids)  # a second step, some storages reused
            again.backward()
            tracker.resync()
        sizes = sorted(tracker.sizes.values())
    finally:
        gc.enable()
    del again
    return trace, tracker.peak, tracker.live, sizes


def test_fast_path_counts_what_the_general_path_counts():
    fast, general = _trace(fast=True), _trace(fast=False)
    assert len(fast[0]) > 100
    assert fast[0] == general[0]  # live and peak bytes after every operation
    assert fast[1:] == general[1:]
    assert fast[1] > fast[2] > 0


Pair = namedtuple("Pair", "a b")


@pytest.mark.parametrize(
    "values",
    [
        (torch.ones(2), 3, None, [torch.ones(1), None, 2.0], torch.float32),
        ([[torch.ones(1)], (torch.ones(2),)], {"k": torch.ones(3)}, Pair(torch.ones(4), 1)),
        (torch.Size([2, 3]), torch.ones(2).as_subclass(Sub), nn.Parameter(torch.ones(2))),
        (torch.ones(3).untyped_storage(), [torch.ones(3).untyped_storage(), "s"], ()),
    ],
)
def test_fast_leaves_are_tree_flattens_tensors_and_storages(values):
    found, expected = [], []
    _leaves(values, found)
    _tree_leaves(list(values), expected)
    assert [id(v) for v in found] == [id(v) for v in expected]
    assert len(expected) == sum(
        isinstance(v, (torch.Tensor, torch.UntypedStorage)) for v in tree_flatten(values)[0]
    )


def test_bench_meter_quick(tmp_path):
    """benchmarks/bench_meter.py in its reduced mode, against a second copy of the tracker."""
    root = pathlib.Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(root / "benchmarks"))  # it imports _common and bench_schedule
    threads = torch.get_num_threads()
    try:
        spec = importlib.util.spec_from_file_location(
            "bench_meter", root / "benchmarks/bench_meter.py"
        )
        bench = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(bench)
        out = tmp_path / "m.json"
        args = ["--quick", "--rounds", "2", "--profile-rounds", "1", "--models", "RevNet-like"]
        baseline = str(root / "revckpt/measure/storages.py")
        result = bench.main([*args, "--baseline", baseline, "--glibc-defaults", "--out", str(out)])
    finally:
        sys.path.remove(str(root / "benchmarks"))
        torch.set_num_threads(threads)
    (row,) = json.loads(out.read_text())["rows"]
    assert row["model"] == "RevNet-like" and row["profile"]["same_bytes"]
    assert set(row["step"]) == {"plain_step_s", "baseline", "current"}
    assert result["rows"][0]["profile"]["cost_in_steps"]["current"]["median"] > 0
