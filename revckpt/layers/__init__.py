"""Reversible building blocks (couplings, ReversibleSequential, ready blocks, converter).

Not yet implemented: the reversible issue (#3) delivers this subpackage. Nothing here is
exported yet, so importing a name from it fails loudly rather than returning a stub.
"""

__all__: list[str] = []
