"""Module paths of jspec 0.1 that moved when the package was reorganised into folders (2026-12), kept
for one release: importing an old path warns (DeprecationWarning) and gives the module it became,
the same object. The next release drops this file."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

MOVED = {
    "jspec.acceptance": "jspec.engine.acceptance",
    "jspec.compare": "jspec.bench.compare",
    "jspec.config": "jspec.model.config",
    "jspec.datastore": "jspec.parts.datastore",
    "jspec.heads": "jspec.parts.heads",
    "jspec.knn": "jspec.parts.knn",
    "jspec.knn_fit": "jspec.training.fit_knn",
    "jspec.native": "jspec.model.kernels",
    "jspec.predictors": "jspec.parts.predictors",
    "jspec.quality": "jspec.bench.quality",
    "jspec.sampling": "jspec.engine.sampling",
    "jspec.sharding": "jspec.model.sharding",
    "jspec.skip_search": "jspec.training.search_skip",
    "jspec.training.predictors": "jspec.training.train_predictors",
    "jspec.training.train": "jspec.training.train_head",
}


class _OldPath(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self):
        self.specs = {}  # module name -> its own spec, which the import system replaces with the old path's

    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if name in MOVED else None

    def create_module(self, spec):
        warnings.warn(f"{spec.name} is now {MOVED[spec.name]}; the old path goes in the next jspec release",
                      DeprecationWarning, stacklevel=2)
        module = importlib.import_module(MOVED[spec.name])
        self.specs[module.__name__] = module.__spec__
        return module

    def exec_module(self, module):
        module.__spec__ = self.specs.pop(module.__name__)


def install() -> None:
    if not any(isinstance(finder, _OldPath) for finder in sys.meta_path):
        sys.meta_path.append(_OldPath())
