"""jspec: self-speculative decoding for Llama-family models in JAX.

    import jspec
    model = jspec.load()                                  # the default SmolLM2-135M-Instruct
    [record] = model.generate("Name three primes.", method="kangaroo")

The package's folders: model/ (the target network), engine/ (one jitted decoding loop),
controllers/, drafters/, parts/ (what drafters carry: heads, predictors, a datastore, KNN-SSD
sets), methods/ (a recipe per method), convert/ (checkpoints in), training/, bench/, cli/.
"""

from jspec import moved
from jspec.api import Model, load
from jspec.errors import JspecError

__version__ = "0.1.0"
__all__ = ["Model", "JspecError", "load", "__version__"]
moved.install()
