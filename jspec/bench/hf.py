"""Hugging Face peers for `jspec bench`: the same weights in a torch model, float32, batch 1.

`hf` is plain greedy `generate`; `hf-early-exit` is HF's self-speculative early exit
(`assistant_early_exit=N`: the first N layers plus the LM head draft, the full model verifies);
`hf-prompt-lookup` is prompt lookup decoding (`prompt_lookup_num_tokens=10`).
"""

from __future__ import annotations

import time

from jspec.errors import JspecError

METHODS = ("hf", "hf-early-exit", "hf-prompt-lookup")
LOOKUP_TOKENS = 10


def load(model_arg: str | None, threads: int | None = None):
    """The torch model of the weights jspec read: from the GGUF file, else from the HF folder."""
    try:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        raise JspecError("--hf runs Hugging Face transformers on torch: pip install -e '.[test]'") from None

    from jspec.convert import cache, store

    if model_arg is None:
        src = str(cache.default_gguf())
    elif store.is_converted(model_arg):
        src = store.read_meta(model_arg)[1].get("source", "")
    else:
        src = model_arg
    if src.endswith(".gguf"):
        from jspec.convert.gguf import read_gguf

        config, tensors, _ = read_gguf(src)
        hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config)).float()
        missing, unexpected = hf.load_state_dict({k: torch.from_numpy(v) for k, v in tensors.items()}, strict=False)
        if hf.config.tie_word_embeddings:
            hf.tie_weights()
            missing = [k for k in missing if k != "lm_head.weight"]
        if missing or unexpected:
            raise JspecError(f"{src} does not fit {type(hf).__name__}: missing {missing[:3]}, "
                             f"unexpected {unexpected[:3]}")
    else:
        from jspec.convert.hf import resolve_hf_dir

        if not src:
            raise JspecError(f"--hf needs the source of {model_arg}, which its jspec.json does not name")
        # Never the folder's own code (an auto_map), never the network.
        hf = AutoModelForCausalLM.from_pretrained(str(resolve_hf_dir(src)), trust_remote_code=False,
                                                  local_files_only=True).float()
    if threads:
        torch.set_num_threads(threads)
    return hf.eval()


def generate(hf, method: str, token_ids: list[int], max_new_tokens: int, eos: list[int],
             exit_layer: int) -> tuple[list[int], float]:
    """(new token ids, seconds) of one greedy `generate` call, timed with perf_counter."""
    import torch

    extra = {"hf-early-exit": {"assistant_early_exit": exit_layer},
             "hf-prompt-lookup": {"prompt_lookup_num_tokens": LOOKUP_TOKENS}}.get(method, {})
    ids = torch.tensor([token_ids])
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                          do_sample=False, eos_token_id=eos, pad_token_id=eos[0], **extra)
        seconds = time.perf_counter() - t0
    return out[0, ids.shape[1]:].tolist(), seconds
