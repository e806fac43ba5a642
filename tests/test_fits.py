"""tpu_scripts/fits.py, the README's what-fits-where table: its sizes come from jspec's shapes and rules."""

from __future__ import annotations

import importlib.util
from pathlib import Path

spec = importlib.util.spec_from_file_location("fits", Path(__file__).resolve().parents[1] / "tpu_scripts" / "fits.py")
fits = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fits)


def test_weights_are_the_published_parameter_counts():
    one = {"data": 1, "model": 1}
    # Llama 3.1 8B and 70B and Llama 3.2 1B as their model cards count them, 2 bytes each in bfloat16.
    for name, params in [("Llama-3.1-8B", 8_030_261_248), ("Llama-3.1-70B", 70_553_706_496),
                         ("Llama-3.2-1B", 1_235_814_400)]:
        assert fits.weights_bytes(fits.config(fits.LLAMAS[name]), one) == 2 * params


def test_int8_weights_are_a_byte_each_and_a_scale_a_row():
    """An int8 matrix [N, D]: N*D bytes and N float32 scales, split with its rows; norms float32.
    The issue's targets: a 70B on a v5e-8, an 8B on one v5e chip (16 GiB) with a small cache."""
    cfg = fits.config(fits.LLAMAS["Llama-3.1-8B"])
    one = {"data": 1, "model": 1}
    bf16, int8 = fits.weights_bytes(cfg, one), fits.weights_bytes(cfg, one, "int8")
    assert 0.5 < int8 / bf16 < 0.501
    d, f, v = 4096, 14336, 128256
    rows = 32 * ((32 + 2 * 8) * 128 + d + 2 * f + d) + 2 * v  # every matrix's output channels
    norms = (2 * 32 + 1) * d
    assert int8 == bf16 // 2 - norms + 4 * norms + 4 * rows
    big = fits.config(fits.LLAMAS["Llama-3.1-70B"])
    v5e = fits.CHIPS["v5e"] * fits.GIB
    assert fits.weights_bytes(big, {"data": 1, "model": 8}) > 0.9 * v5e  # bfloat16 does not fit a v5e-8
    assert fits.weights_bytes(big, {"data": 1, "model": 8}, "int8") + fits.cache_bytes(
        big, {"data": 1, "model": 8}, rows=8, context=4096) < 0.9 * v5e
    assert int8 + fits.cache_bytes(cfg, one, rows=1, context=2048, dtype="bfloat16") < 0.9 * v5e < bf16


def test_cache_splits_over_kv_heads_only_while_they_divide():
    cfg = fits.config(fits.LLAMAS["Llama-3.1-8B"])  # 8 kv heads
    whole = fits.cache_bytes(cfg, {"data": 1, "model": 1}, rows=8, context=4096)
    assert whole == 2 * 32 * 4 * 8 * 4096 * 8 * 128  # k and v, 32 layers, float32, rows x positions x heads x dim
    assert fits.cache_bytes(cfg, {"data": 1, "model": 8}, rows=8, context=4096) == whole // 8
    assert fits.cache_bytes(cfg, {"data": 1, "model": 16}, rows=8, context=4096) == whole
    assert fits.cache_bytes(cfg, {"data": 4, "model": 8}, rows=8, context=4096) == whole // 8  # 4x the rows, over 4


def test_host_memory_follows_the_pieces():
    """Llama-3.1-8B's largest piece is its embedding (with the final norm) or its LM head, in
    bfloat16: a layer (436 MB) is a piece alone; a conversion holds a piece and its source."""
    cfg = fits.config(fits.LLAMAS["Llama-3.1-8B"])
    assert fits.largest_piece(cfg) == 2 * (128256 * 4096 + 4096)
    converting, loading = fits.host_memory(cfg)
    assert converting == fits.PROCESS + 2 * fits.largest_piece(cfg) and loading < converting
