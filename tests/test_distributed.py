"""Every strategy under DistributedDataParallel (with and without find_unused_parameters) and
FSDP2 (fully_shard): gloo, 2 CPU processes on loopback, gradients equal to one process.

One launch runs every (strategy, wrapper) pair in the same process group; the test compares
each with the same model run on the whole batch in this process.
"""

import os
import pathlib
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import free_port
from torch import nn

import revckpt
from revckpt.approx import Approx
from revckpt.layers import ReversibleSequential, ReversibleUnit, reversible_mlp_block
from revckpt.models import ResidualMLPBlock
from revckpt.schedule import Plan, Segment, apply, make_plan, profile

WORLD = 2
STRATEGIES = (
    "reversible",
    "checkpoint",
    "selective",
    "approx-bf16",
    "approx-e4m3",
    "offload",
    "scheduled",
    "make_reversible",
)
WRAPPERS = ("ddp", "ddp-find-unused", "fsdp2")
SCHEDULE = [
    Segment(0, 1, "approx:bf16"),
    Segment(1, 3, "reversible"),
    Segment(3, 4, "checkpoint"),
    Segment(4, 5, "offload"),
]


def _chain() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        ResidualMLPBlock(12, 24, norm="layer", activation=nn.GELU),
        ReversibleUnit(reversible_mlp_block(6, 12)),
        ReversibleUnit(reversible_mlp_block(6, 12)),
        ResidualMLPBlock(12, 24, norm="layer", activation=nn.GELU),
        ResidualMLPBlock(12, 24, norm="layer", activation=nn.GELU),
    ).double()


class Net(nn.Module):
    """One strategy over the same chain; ``unused`` adds a parameter no forward touches."""

    def __init__(self, strategy: str, plan: Plan | None, unused: bool = False) -> None:
        super().__init__()
        self.strategy = strategy
        if strategy == "reversible":
            torch.manual_seed(0)
            self.body = ReversibleSequential(*[reversible_mlp_block(6, 12) for _ in range(4)])
            self.body.double()
        elif strategy == "make_reversible":  # a "pretrained" stack, converted (MEFT)
            torch.manual_seed(0)
            self.body = nn.Sequential(
                *[ResidualMLPBlock(12, 24, norm="layer", activation=nn.GELU) for _ in range(4)]
            ).double()
            revckpt.make_reversible(self.body, trainable="all")
            for name, p in self.body.named_parameters():
                if "revckpt_adapter" in name:
                    p.data.normal_(0, 0.1)
        elif strategy == "scheduled":
            assert plan is not None
            self.body = apply(_chain(), plan)
        else:
            self.body = _chain()
        self.unused = nn.Linear(3, 3).double() if unused else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.strategy == "checkpoint":
            return revckpt.checkpoint_sequential(self.body, len(self.body), x)
        if self.strategy == "selective":
            return revckpt.checkpoint_sequential(
                self.body, len(self.body), x, strategy="selective:matmul"
            )
        if self.strategy == "offload":
            return revckpt.checkpoint_sequential(self.body, len(self.body), x, strategy="offload")
        if self.strategy.startswith("approx-"):
            fmt = self.strategy.split("-")[1]
            return revckpt.checkpoint_sequential(
                self.body, len(self.body), x, strategy=Approx(store=fmt)
            )
        return self.body(x)


def data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 12, generator=g, dtype=torch.float64)
    w = torch.randn(8, 12, generator=g, dtype=torch.float64)
    return x, w


def _steps(model: nn.Module, x: torch.Tensor, w: torch.Tensor) -> None:
    for _ in range(2):  # two steps: gradient accumulation across iterations
        (model(x) * w).sum().backward()


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad
            out[name.replace("module.", "")] = g.full_tensor() if hasattr(g, "full_tensor") else g
    return out


def _worker(rank: int, port: int, plan_path: str, out: str) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    revckpt.offload._FORCED.append([False])  # the offload copy path, as on an accelerator
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.nn.parallel import DistributedDataParallel as DDP

        mesh = init_device_mesh("cpu", (WORLD,))
        plan = Plan.from_json(pathlib.Path(plan_path))
        x, w = data()
        results = {}
        for strategy in STRATEGIES:
            for wrapper in WRAPPERS:
                net = Net(strategy, plan, unused=wrapper == "ddp-find-unused")
                if wrapper == "fsdp2":
                    fully_shard(net, mesh=mesh)
                    model = net
                else:
                    model = DDP(net, find_unused_parameters=wrapper == "ddp-find-unused")
                _steps(model, x[rank::WORLD], w[rank::WORLD])
                results[(strategy, wrapper)] = _grads(model)
        if rank == 0:
            torch.save(results, out)
    finally:
        dist.destroy_process_group()


def _launch(port: int, plan_path: str, out: str) -> None:
    mp.start_processes(_worker, args=(port, plan_path, out), nprocs=WORLD, start_method="fork")


@pytest.fixture(scope="module")
def distributed_grads(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dist")
    x, _ = data()
    plan = make_plan(
        profile(_chain(), x, repeats=1, codecs=("bf16",), policies=(), offload=True), SCHEDULE
    )
    plan_path = folder / "plan.json"
    plan.to_json(plan_path)
    out = folder / "grads.pt"
    # Fork from a fresh interpreter: forking the test process itself can hang once earlier
    # tests have started OpenMP worker threads (libgomp is not fork-safe).
    here = pathlib.Path(__file__).resolve().parent
    code = (
        f"import sys; sys.path[:0] = [{str(here)!r}, {str(here.parent)!r}]; "
        f"import test_distributed as t; t._launch({free_port()}, {str(plan_path)!r}, "
        f"{str(out)!r})"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=600)
    return torch.load(out), plan


@pytest.mark.parametrize("wrapper", WRAPPERS)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_gradients_equal_one_process(distributed_grads, strategy, wrapper):
    results, plan = distributed_grads
    got = results[(strategy, wrapper)]
    model = Net(strategy, plan)
    x, w = data()
    _steps(model, x, w)
    single = _grads(model)
    assert got.keys() == single.keys() and len(single) > 0
    for name, g in single.items():
        # DDP and FSDP2 average the two shards' gradients; one process sums the whole batch
        torch.testing.assert_close(WORLD * got[name], g, rtol=1e-10, atol=1e-12)
