"""Small built-in models used by tests, the demo and the benchmarks.

* GPT-like: :func:`gpt_like` / :func:`transformer_chain` (pre-norm causal transformer blocks),
  and :func:`rev_gpt_like`, a reversible counterpart;
* RevNet-like: :func:`revnet_like` (stem, reversible units, downsampling blocks, head);
* :func:`mlp_chain` (residual MLP blocks).
"""

from .mlp import ResidualMLPBlock, mlp_chain
from .revnet import ClassifierHead, revnet_like
from .transformer import TransformerBlock, gpt_like, rev_gpt_like, transformer_chain

__all__ = [
    "ClassifierHead",
    "ResidualMLPBlock",
    "TransformerBlock",
    "gpt_like",
    "mlp_chain",
    "rev_gpt_like",
    "revnet_like",
    "transformer_chain",
]
