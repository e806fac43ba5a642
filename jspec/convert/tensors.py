"""A checkpoint's tensors by Hugging Face name, each read from its file only when asked for.

Conversion streams: it asks for the few tensors of one layer, fuses and casts them, writes them
and lets them go, so a checkpoint is never in host memory whole (`jspec.convert.store`). A
tensor comes back in the dtype its file holds it in (bfloat16 as `ml_dtypes.bfloat16`, a GGUF
quantization dequantized to float32), a new array each time, tied to no memory map.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

import numpy as np


class Tensors(Mapping):
    """name -> array, read when looked up; `shape(name)` without reading."""

    def __init__(self, readers: Mapping[str, Callable[[], np.ndarray]], shapes: Mapping[str, tuple[int, ...]]):
        self._readers, self._shapes = dict(readers), dict(shapes)

    def __getitem__(self, name: str) -> np.ndarray:
        return self._readers[name]()

    def __iter__(self) -> Iterator[str]:
        return iter(self._readers)

    def __len__(self) -> int:
        return len(self._readers)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]
