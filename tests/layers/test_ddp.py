"""ReversibleSequential under DistributedDataParallel: gloo, 2 CPU processes on loopback."""

import os
import pathlib
import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from revckpt.layers import ReversibleSequential, reversible_mlp_block

WORLD = 2


class Model(nn.Module):
    def __init__(self, with_unused: bool):
        super().__init__()
        torch.manual_seed(0)
        self.rev = ReversibleSequential(*[reversible_mlp_block(6, 12) for _ in range(4)])
        self.unused = nn.Linear(3, 3) if with_unused else None

    def forward(self, x):
        return self.rev(x)


def data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 12, generator=g, dtype=torch.float64)
    w = torch.randn(8, 12, generator=g, dtype=torch.float64)
    return x, w


def _worker(rank, port, find_unused, out):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        model = DDP(Model(with_unused=find_unused).double(), find_unused_parameters=find_unused)
        x, w = data()
        for _ in range(2):  # two steps: gradient accumulation across iterations with DDP
            (model(x[rank::WORLD]) * w[rank::WORLD]).sum().backward()
        if rank == 0:
            torch.save(
                {n: p.grad for n, p in model.module.named_parameters() if p.grad is not None}, out
            )
    finally:
        dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(port, find_unused, out):
    mp.start_processes(_worker, args=(port, find_unused, out), nprocs=WORLD, start_method="fork")


@pytest.mark.parametrize("find_unused", [False, True])
def test_ddp_gradients_equal_single_process(tmp_path, find_unused):
    out = tmp_path / "grads.pt"
    # Fork from a fresh interpreter: forking the test process itself can hang once earlier
    # tests have started OpenMP worker threads (libgomp is not fork-safe).
    here = pathlib.Path(__file__).resolve().parent
    code = (
        f"import sys; sys.path[:0] = [{str(here)!r}, {str(here.parent)!r}]; import test_ddp; "
        f"test_ddp._launch({_free_port()}, {find_unused!r}, {str(out)!r})"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
    ddp_grads = torch.load(out)

    model = Model(with_unused=find_unused).double()
    x, w = data()
    for _ in range(2):
        (model(x) * w).sum().backward()
    single = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert ddp_grads.keys() == single.keys() and len(single) > 0
    for name, g in single.items():
        # DDP averages the two shards' gradients; the single process sums over the whole batch
        torch.testing.assert_close(WORLD * ddp_grads[name], g, rtol=1e-12, atol=1e-12)
