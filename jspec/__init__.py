"""jspec: self-speculative decoding for Llama-family models in JAX."""

from jspec.api import Model, load
from jspec.errors import JspecError

__version__ = "0.1.0"
__all__ = ["Model", "JspecError", "load", "__version__"]
