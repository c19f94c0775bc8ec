"""Every strategy on one GPU: peak memory (``torch.cuda.max_memory_allocated`` through
``MemoryMeter("cuda")``) and step time against store-all, on the GPT-like model at a GPU size,
plus an fp16 autocast + ``GradScaler`` step for the exact strategies.

Rows: store-all; checkpoint per block (revckpt, and ``torch.utils.checkpoint``); sqrt segments;
selective recompute (``matmul+attention``); approx bf16 and e4m3 boundaries; a bf16 recompute;
host offload per block (with and without prefetch; its retained device bytes after the forward
are printed next to checkpoint's); the scheduler's plan at 30% of store-all (error budget 1e-2,
offload priced); a reversible model of the same size (``rev_gpt_like``, against its own
store-all) run by revckpt and by the reversible peers when installed (revlib, revtorch,
memcnn: ``pip install -e '.[bench]'`` and ``pip install --no-deps memcnn==1.5.2``); and
``make_reversible`` at its defaults on a GPT, its exact rebuild checked against plain
autograd on the device (``_gpu_reversible.py``).

Run ``python benchmarks/gpu_check.py`` on a GPU (about 3 minutes on one H100-class GPU);
without CUDA it runs a reduced CPU smoke mode (``--smoke`` forces it). Prints a table and
writes ``benchmarks/results/gpu_check.json``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint
from _common import environment, reversible_peers, write_json  # benchmarks/_common.py
from _gpu_reversible import reversible_lines, reversible_rows

import revckpt
from revckpt import MemoryMeter, time_ratios
from revckpt.approx import Approx
from revckpt.models import gpt_like, rev_gpt_like
from revckpt.schedule import apply, profile, solve

SIZES = {
    # depth, dim, heads, batch, sequence
    "gpu": (24, 1024, 16, 8, 1024),
    "smoke": (2, 32, 2, 2, 16),
}


def _step(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        fn(x).float().sum().backward()

    return step


_reserved: dict[str, int] = {}  # CUDA: the allocator's reserved peak per variant


def _peak(step: Callable[[], None], device: str, name: str = "") -> int:
    step()  # warm: gradients allocated, kernels chosen
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    with MemoryMeter(device) as meter:
        step()
    if device == "cuda":
        # what the caching allocator held: above the allocated peak by the memory released
        # but not yet reusable (an offloaded boundary whose copy out is in flight) and slack
        _reserved[name] = torch.cuda.max_memory_reserved()
    return meter.peak_bytes


def _variants(
    chain: torch.nn.Sequential, x: torch.Tensor, budget: float
) -> dict[str, Callable[..., Any]]:
    n = len(chain)

    def torch_per_block(h: torch.Tensor) -> torch.Tensor:
        for block in chain:
            h = torch_checkpoint.checkpoint(block, h, use_reentrant=False)
        return h

    prof = profile(chain, x, repeats=3)  # offload priced on an accelerator
    plan = solve(prof, memory_budget=budget, error_budget=1e-2)
    scheduled = apply(chain, plan)
    return {
        "store-all": chain,
        "checkpoint per block": lambda h: revckpt.checkpoint_sequential(chain, n, h),
        "torch.utils.checkpoint per block": torch_per_block,
        "checkpoint sqrt": lambda h: revckpt.checkpoint_sequential(chain, "sqrt", h),
        "selective matmul+attention": lambda h: revckpt.checkpoint_sequential(
            chain, n, h, strategy="selective:matmul+attention"
        ),
        "approx bf16": lambda h: revckpt.checkpoint_sequential(
            chain, n, h, strategy=Approx(store="bf16")
        ),
        "approx e4m3": lambda h: revckpt.checkpoint_sequential(
            chain, n, h, strategy=Approx(store="e4m3")
        ),
        "bf16 recompute": lambda h: revckpt.checkpoint_sequential(
            chain, n, h, strategy=Approx(store=None, recompute_dtype=torch.bfloat16)
        ),
        "offload per block": lambda h: revckpt.checkpoint_sequential(
            chain, n, h, strategy="offload"
        ),
        "offload per block, no prefetch": lambda h: revckpt.checkpoint_sequential(
            chain, n, h, strategy=revckpt.offload.Offload(prefetch=False)
        ),
        f"scheduler ({', '.join(sorted(set(plan.strategies)))})": scheduled,
    }


def _retained(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, device: str) -> int:
    """Bytes a forward leaves on the device for its backward, beyond its output. The chain
    input is made inside, as an activation (after an embedding, say), not held by the caller:
    a checkpoint keeps all ``depth`` boundaries, offload none."""
    with MemoryMeter(device) as meter:
        h = x * 1
        y = fn(h)
        del h
        if device == "cuda":
            torch.cuda.synchronize()  # the copies to host done
    kept = meter.end_bytes - y.numel() * y.element_size()
    y.float().sum().backward()
    return kept


def _fresh_step(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> Callable[[], None]:
    """A step on a fresh copy of ``x`` (memcnn frees its input's storage)."""

    def step() -> None:
        fn(x.detach().clone().requires_grad_(True)).float().sum().backward()

    return step


def _fp16_scaler_rows(chain, x, device) -> list[dict[str, Any]]:
    """One fp16 autocast + GradScaler step per strategy: finite gradients, and their relative
    difference from store-all's under the same autocast (unscaled; 0 for exact strategies)."""
    rows = []
    n = len(chain)
    reference: list[torch.Tensor] | None = None
    for name, fn in (
        ("store-all", chain),
        ("checkpoint per block", lambda h: revckpt.checkpoint_sequential(chain, n, h)),
        (
            "offload per block",
            lambda h: revckpt.checkpoint_sequential(chain, n, h, strategy="offload"),
        ),
        (
            "approx e4m3",
            lambda h: revckpt.checkpoint_sequential(chain, n, h, strategy=Approx(store="e4m3")),
        ),
    ):
        scaler = torch.amp.GradScaler(device)
        for p in chain.parameters():
            p.grad = None
        with torch.autocast(device, dtype=torch.float16):
            loss = fn(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        grads = [p.grad.double() / scaler.get_scale() for p in chain.parameters()]
        finite = all(bool(torch.isfinite(g).all()) for g in grads)
        if reference is None:
            reference = grads
        diff = sum(float((g - r).pow(2).sum()) for g, r in zip(grads, reference, strict=True))
        norm = sum(float(r.pow(2).sum()) for r in reference)
        rows.append(
            {
                "variant": name,
                "fp16_gradscaler_finite_grads": finite,
                "relative_difference_from_store_all": (diff / norm) ** 0.5 if norm else 0.0,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="reduced CPU mode")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "gpu_check.json"
    )
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.smoke
    device = "cuda" if cuda else "cpu"
    size = "gpu" if cuda else "smoke"
    depth, dim, heads, batch, seq = SIZES[size]
    if not cuda:
        torch.set_num_threads(1)
    started = time.perf_counter()
    torch.manual_seed(0)
    chain = gpt_like(depth, dim, heads).to(device)
    x = torch.randn(batch, seq, dim, device=device, requires_grad=True)
    variants = _variants(chain, x, 0.3 if cuda else 0.9)  # the tiny smoke model: 0.9
    steps = {name: _step(fn, x) for name, fn in variants.items()}
    peaks = {name: _peak(step, device, name) for name, step in steps.items()}
    ratios = time_ratios(steps, baseline="store-all", repeats=args.repeats, warmup=1)
    rows = [
        {
            "variant": name,
            "peak_bytes": peaks[name],
            "peak_fraction": peaks[name] / peaks["store-all"],
            "time_ratio": ratios[name].ratio,
            "time_ratio_iqr": [ratios[name].q25, ratios[name].q75],
            "reserved_peak_bytes": _reserved.get(name),
        }
        for name in variants
    ]
    # the reversible model of the same size, against its own store-all
    rev = rev_gpt_like(depth, dim, heads).to(device)
    rev_plain = torch.nn.Sequential(*rev)  # same blocks, run plainly (they store)
    from revckpt.layers import ReversibleSequential

    rev_stack = ReversibleSequential(*[unit.block for unit in rev], split_dim=-1)
    # the same F and G modules; the streams split along the last dimension of (b, s, d)
    peer_fns, notes = reversible_peers([unit.block for unit in rev], split_dim=2)
    rev_fns = {"store-all": rev_plain, "revckpt reversible": rev_stack, **peer_fns}
    rev_steps = {name: _fresh_step(fn, x) for name, fn in rev_fns.items()}
    rev_peaks = {name: _peak(step, device) for name, step in rev_steps.items()}
    rev_ratios = time_ratios(rev_steps, baseline="store-all", repeats=args.repeats, warmup=1)
    for label in rev_fns:
        if label == "store-all":
            continue
        rows.append(
            {
                "variant": f"{label} (RevGPT variant, against its own store-all)",
                "peak_bytes": rev_peaks[label],
                "peak_fraction": rev_peaks[label] / rev_peaks["store-all"],
                "time_ratio": rev_ratios[label].ratio,
                "time_ratio_iqr": [rev_ratios[label].q25, rev_ratios[label].q75],
            }
        )
    retained = {
        name: _retained(variants[name], x, device)
        for name in ("checkpoint per block", "offload per block")
    }
    fp16 = _fp16_scaler_rows(chain, x.detach(), device)  # CPU autocast takes fp16 too
    finetune = reversible_rows(device, size)  # make_reversible's exact rebuild on the device
    name = torch.cuda.get_device_name() if cuda else "CPU (smoke mode)"
    lines = [
        f"gpu_check on {name}, GPT-like {depth} blocks x {dim}, input {batch}x{seq}x{dim}, "
        f"torch {torch.__version__}",
        "| variant | peak MiB | of store-all | time vs store-all (IQR) | reserved peak MiB |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        reserved = r.get("reserved_peak_bytes")
        lines.append(
            f"| {r['variant']} | {r['peak_bytes'] / 2**20:.1f} | {r['peak_fraction']:.3f} | "
            f"{r['time_ratio']:.3f} ({r['time_ratio_iqr'][0]:.2f}-{r['time_ratio_iqr'][1]:.2f}) | "
            f"{'-' if reserved is None else f'{reserved / 2**20:.1f}'} |"
        )
    for r in fp16:
        lines.append(
            f"fp16 autocast + GradScaler, {r['variant']}: finite gradients "
            f"{r['fp16_gradscaler_finite_grads']}, relative difference from store-all "
            f"{r['relative_difference_from_store_all']:.1e}"
        )
    boundary = x.numel() * x.element_size()
    lines.append(
        "retained device bytes after the forward, beyond the output: "
        + ", ".join(f"{k} {v:,} ({v / boundary:.2f} boundaries)" for k, v in retained.items())
    )
    lines += reversible_lines(finetune)
    lines += notes
    elapsed = time.perf_counter() - started
    lines.append(f"({elapsed:.0f} s)")
    print("\n".join(lines))
    result = {
        "benchmark": "gpu_check",
        "command": "python benchmarks/gpu_check.py",
        "environment": environment(),
        "device": name,
        "size": size,
        "rows": rows,
        "fp16_gradscaler": fp16,
        "make_reversible": finetune,
        "retained_after_forward_bytes": retained,
        "boundary_bytes": boundary,
        "notes": notes,
        "seconds": elapsed,
    }
    write_json(result, args.out)
    return result


if __name__ == "__main__":
    main()
