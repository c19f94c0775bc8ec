"""Low-precision paths: compressed checkpoint boundaries and bf16 recompute.

Not yet implemented: the approximate-recompute issue (#4) delivers this subpackage. Nothing
here is exported yet, so importing a name from it fails loudly rather than returning a stub.
"""

__all__: list[str] = []
