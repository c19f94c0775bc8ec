"""revckpt in one minute: checkpoint a 32-block MLP and measure what it saved and what it cost.

Run: python examples/quickstart.py
"""

import torch
from torch import nn

from revckpt import MemoryMeter, checkpoint_sequential, gradient_error, time_ratio
from revckpt.models import mlp_chain


class Chain(nn.Module):
    """A chain of blocks run plainly (segments=None) or with checkpoint segments."""

    def __init__(self, blocks, segments=None):
        super().__init__()
        self.blocks = blocks
        self.segments = segments

    def forward(self, x):
        if self.segments is None:
            return self.blocks(x)
        return checkpoint_sequential(self.blocks, self.segments, x)


torch.manual_seed(0)
torch.set_num_threads(1)
blocks = mlp_chain(32, 128, 512, dropout=0.1, norm="batch")  # 32 residual blocks
x = torch.randn(512, 128, requires_grad=True)
models = {
    "plain autograd": Chain(blocks),
    "checkpoint every block": Chain(blocks, segments=32),
    "checkpoint sqrt(32) segments": Chain(blocks, segments="sqrt"),
}


def step(model):
    def run():
        model(x).sum().backward()
        model.zero_grad(set_to_none=True)

    return run


print(f"{'strategy':<30} {'kept after forward':>19} {'peak fwd+bwd':>13} {'time vs plain':>14}")
for name, model in models.items():
    with MemoryMeter("cpu") as kept:
        y = model(x)
    del y
    with MemoryMeter("cpu") as peak:
        step(model)()
    if model is models["plain autograd"]:
        timing = "baseline"
    else:
        ratio = time_ratio(step(model), step(models["plain autograd"]), repeats=7, warmup=1)
        timing = f"{ratio.ratio:.2f}x"
    print(
        f"{name:<30} {kept.end_bytes / 2**20:>15.2f} MiB {peak.peak_bytes / 2**20:>9.2f} MiB "
        f"{timing:>14}"
    )

exact = gradient_error(models["checkpoint every block"], models["plain autograd"], x)
f64 = gradient_error(models["checkpoint every block"], None, x)
print(
    f"\ngradient error, checkpoint vs plain autograd (same dropout masks): "
    f"{exact.overall.rel_l2:.1e}\n"
    f"gradient error, checkpoint (float32) vs a float64 copy: {f64.overall.rel_l2:.1e}"
)
