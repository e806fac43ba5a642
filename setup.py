"""Builds jspec's optional native kernels, jspec/model/kernels/matmul.cc and attention.cc (the rest
of the package is in pyproject.toml).

jspec works without it: a failed compile is a warning, and jspec/model/kernels/__init__.py then reports the
kernel as unavailable and `decoder.linear` keeps to its pure-JAX path.
"""

import importlib.util
import os

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class OptionalBuildExt(build_ext):
    def run(self):
        try:
            super().run()
        except Exception as e:  # no compiler at all, say
            self.warn(f"jspec's native kernel was not built ({e}); jspec will use its pure-JAX path")

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as e:
            self.warn(f"jspec's native kernel was not built ({e}); jspec will use its pure-JAX path")


def native_extensions() -> list[Extension]:
    # XLA's FFI headers ship inside jaxlib (build-system requires it); found without importing jax.
    spec = importlib.util.find_spec("jaxlib")
    if spec is None or not spec.submodule_search_locations:
        print("jspec: jaxlib not found at build time, so the native kernel is not built")
        return []
    include = os.path.join(spec.submodule_search_locations[0], "include")
    return [Extension("jspec.model.kernels._native",
                      ["jspec/model/kernels/matmul.cc", "jspec/model/kernels/attention.cc"],
                      depends=["jspec/model/kernels/common.h"], include_dirs=[include], language="c++",
                      extra_compile_args=["-O3", "-std=c++17"])]


setup(ext_modules=native_extensions(), cmdclass={"build_ext": OptionalBuildExt})
