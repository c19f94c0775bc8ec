"""Small built-in models used by tests, the demo and the benchmarks."""

from .mlp import ResidualMLPBlock, mlp_chain
from .transformer import TransformerBlock, transformer_chain

__all__ = ["ResidualMLPBlock", "TransformerBlock", "mlp_chain", "transformer_chain"]
