"""The target network: its config, the decoder as pure functions (decoder, attention), the weights'
dtypes, int8 included (weights), the activations' dtypes and precision (numerics), Hugging Face's
layout of its weights (layout), their sharding (sharding), the CPU's and the GPU's kernels (kernels)
and the running softmax of the loops over the filled part of the cache (online_softmax).

jspec 0.1's `jspec.model` module is now `jspec.model.decoder` (and `layout`, `attention`): its
names are still read here, with a DeprecationWarning, until the next release."""


SUBMODULES = ("attention", "config", "decoder", "kernels", "layout", "numerics", "online_softmax", "sharding",
              "weights")


def __getattr__(name: str):
    import importlib
    import warnings

    if name in SUBMODULES:  # not imported yet: the import system imports it once this refuses
        raise AttributeError(name)
    for module in ("decoder", "layout", "attention"):
        found = importlib.import_module(f"jspec.model.{module}")
        if hasattr(found, name) and not name.startswith("_"):
            warnings.warn(f"jspec.model.{name} is now jspec.model.{module}.{name}; the old name goes in the next "
                          "jspec release", DeprecationWarning, stacklevel=2)
            return getattr(found, name)
    raise AttributeError(f"module 'jspec.model' has no attribute {name!r}")
