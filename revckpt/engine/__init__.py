"""The recompute engine: keep less in forward, rebuild it in backward.

Every strategy that trades compute for activation memory runs through this package; each only
says *what* it keeps and *how* it rebuilds it:

* :mod:`~revckpt.engine.frame`: exact checkpoints and selective policies (``revckpt.checkpoint``):
  torch's non-reentrant checkpoint frame keeps the block input (a policy also the outputs of the
  operations it names) and recomputes the rest on the first unpack in backward, under replay.
* :mod:`~revckpt.engine.node`: the recompute node, one ``autograd.Function`` per block call whose
  :class:`~revckpt.engine.node.Keep` keeps the block's tensor arguments exactly (host offload
  moves them with saved-tensor hooks) or compressed (``revckpt.approx``), and whose backward
  rebuilds them and re-runs the block.
* :mod:`~revckpt.engine.rerun`: a block's first forward inside a node and its re-run in
  backward: keyword tensors that require grad as fresh leaves, parameters with backward hooks
  through detached aliases, the check that no gradient is dropped. The reversible half steps
  (:mod:`revckpt.layers.rebuild`) use it too.
* :mod:`~revckpt.engine.chain`: chains of blocks run in segments (``checkpoint_sequential``).
* :mod:`~revckpt.engine.autograd`: the plumbing under all of them (which tensors a module's
  recompute differentiates, a lean VJP, double-backward refusal).

Forward-time state (RNG, autocast, BatchNorm statistics, module state) is captured and replayed
by :mod:`revckpt.replay` alone. The engine imports nothing of the strategies.
"""
