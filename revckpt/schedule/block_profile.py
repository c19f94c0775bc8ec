"""One block profiled on its own: every figure of :class:`~revckpt.schedule.costs.BlockCost`,
its times measured on the block alone (what :func:`revckpt.fit` does for a model's blocks)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..errors import Float16RangeError
from ..strategy import Strategy
from .block_errors import error_fields
from .block_memory import memory_costs
from .block_time import block_times, codec_seconds, derived_codecs
from .costs import APPROX, CHECKPOINT, COMPRESS, OFFLOAD, REVERSIBLE, SELECTIVE, STORE, BlockCost
from .sensitivities import Exact


def profile_block(
    block: nn.Module,
    x: torch.Tensor,
    *,
    codecs: Sequence[str],
    policies: Sequence[str],
    repeats: int,
    device: Any,
    kwargs: dict[str, Any],
    cotangent: torch.Tensor | None = None,
    compress: Sequence[str] = (),
    offload: bool = False,
    grads_new: bool = False,
    output: torch.Tensor | None = None,
    capture: bool = True,
    exact: Exact | None = None,
) -> BlockCost:
    """Every figure of one block on input ``x``, its times measured on the block alone (what
    :func:`revckpt.fit` does for a model's blocks, each on its own arguments); ``output`` and
    ``capture`` as in :func:`~revckpt.schedule.block_memory.memory_costs`; ``exact``: the
    block's exact gradients on ``x`` (:func:`~revckpt.schedule.sensitivities.sensitivities`),
    which spare the error fields their exact run. A float16 block whose approx recompute
    overflows (:class:`~revckpt.Float16RangeError`: values near 65504 rounded past it) is
    priced without the approx codecs, which no plan then gives it."""
    try:
        leaf = x.detach().requires_grad_(x.is_floating_point())
        memory = memory_costs(
            block,
            leaf,
            codecs,
            policies,
            device,
            kwargs,
            compress=compress,
            offload=offload,
            grads_new=grads_new,
            output=output,
            capture=capture,
        )
        fields = dict(memory.fields)
        codecs_priced = list(fields["approx"])
        f, b, overhead = block_times(
            block,
            leaf,
            memory.grad_out,
            one_block_strategies(fields, offload)[1:],  # besides store
            kwargs,
            repeats,
            reversible=memory.runs.reversible,
            warmup=0,  # memory_costs has just run each of these steps
        )
        if codecs_priced:
            overhead = derived_codecs(overhead, codec_seconds(x, codecs_priced), codecs_priced[0])
        fields.update(
            error_fields(block, x, fields["approx"], fields["compress"], cotangent, kwargs, exact)
        )
        fields.update(
            forward_s=f,
            backward_s=b,
            strategy_overhead_s=overhead,
            chained_s=overhead.get(CHECKPOINT, f),
        )
        return BlockCost(**fields)
    except Float16RangeError:
        if not codecs:
            raise
        return profile_block(
            block, x, codecs=(), policies=policies, repeats=repeats, device=device,
            kwargs=kwargs, cotangent=cotangent, compress=compress, offload=offload,
            grads_new=grads_new, output=output, capture=capture, exact=exact,
        )  # fmt: skip


def one_block_strategies(fields: dict[str, Any], offload: bool) -> list[str]:
    """The strategies a block with these memory ``fields`` (:func:`memory_costs`) can run with
    on its own, store first: checkpoint, the first codec priced, the selective policies, the
    compress formats, reversible when the block is invertible, offload when asked. Their
    order is the order they are timed in and that of ``strategy_overhead_s``."""
    strategies = [STORE, CHECKPOINT]
    if fields["approx"]:
        strategies.append(str(Strategy(APPROX, next(iter(fields["approx"])))))
    strategies += [str(Strategy(SELECTIVE, p)) for p in fields["selective"]]
    strategies += [str(Strategy(COMPRESS, c)) for c in fields["compress"]]
    if fields["invertible"]:
        strategies.append(REVERSIBLE)
    if offload:
        strategies.append(OFFLOAD)
    return strategies
