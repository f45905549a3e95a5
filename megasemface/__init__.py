"""megasemface: pre-training neural machine translation with SemFace semantic interfaces."""

__version__ = "0.1.0"
__all__ = ["__version__"]
