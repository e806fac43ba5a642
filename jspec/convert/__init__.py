"""Checkpoint conversion: readers for Hugging Face and GGUF sources; see jspec.convert.store for saving."""
