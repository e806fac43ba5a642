"""Model hyper-parameters, read from a Hugging Face `config.json` dict.

The config is a frozen dataclass so it can be a static argument of `jax.jit`.
"""

from __future__ import annotations

import dataclasses
import math

from jspec.errors import JspecError

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    # llama3 scaling as (factor, low_freq_factor, high_freq_factor, original_max_position).
    rope_llama3: tuple[float, float, float, int] | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def group_size(self) -> int:
        """Query heads per key/value head (grouped-query attention)."""
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf(cls, hf: dict) -> "ModelConfig":
        try:
            return cls._from_hf(hf)
        except KeyError as e:  # a field every supported architecture's config.json has
            raise JspecError(f"config.json lacks {e.args[0]!r}") from None

    @classmethod
    def _from_hf(cls, hf: dict) -> "ModelConfig":
        archs = hf.get("architectures") or []
        model_type = hf.get("model_type", "")
        arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None and model_type in SUPPORTED_ARCHITECTURES.values():
            arch = model_type
        if arch is None:
            name = ", ".join(archs) or model_type or "unknown"
            raise JspecError(
                f"unsupported architecture {name}; jspec supports "
                + ", ".join(SUPPORTED_ARCHITECTURES)
            )
        heads = hf["num_attention_heads"]
        hidden = hf["hidden_size"]
        scaling = hf.get("rope_scaling") or hf.get("rope_parameters") or None
        rope_theta = hf.get("rope_theta") or (scaling or {}).get("rope_theta") or 10000.0
        llama3 = None
        if scaling and scaling.get("rope_type", scaling.get("type")) == "llama3":
            llama3 = (
                float(scaling["factor"]),
                float(scaling["low_freq_factor"]),
                float(scaling["high_freq_factor"]),
                int(scaling["original_max_position_embeddings"]),
            )
        elif scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
            raise JspecError(f"unsupported rope scaling {scaling.get('rope_type')!r}; jspec supports default and llama3")
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        max_pos = hf.get("max_position_embeddings", 2048)
        if arch == "mistral" and hf.get("sliding_window"):
            # Full attention equals sliding-window attention only up to the window.
            max_pos = min(max_pos, hf["sliding_window"])
        return cls(
            arch=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hidden,
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hidden // heads,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=arch == "qwen2" or bool(hf.get("attention_bias")),  # Qwen2 always has q/k/v bias
            rope_llama3=llama3,
            eos_token_ids=eos_ids,
        )

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "ModelConfig":
        d = dict(d)
        for key in ("rope_llama3", "eos_token_ids"):
            if d.get(key) is not None:
                d[key] = tuple(d[key])
        return cls(**d)


def rope_inv_freq(cfg: ModelConfig):
    """Inverse frequencies exactly as transformers computes them (default or llama3)."""
    import numpy as np

    # float32 throughout, as transformers does, so positions far out round the same way.
    exponent = np.arange(0, cfg.head_dim, 2).astype(np.float32) / np.float32(cfg.head_dim)
    inv = np.float32(1.0) / (np.float32(cfg.rope_theta) ** exponent)
    if cfg.rope_llama3 is not None:
        factor, low, high, old_ctx = cfg.rope_llama3
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        medium = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = np.where(is_medium, medium, scaled)
    return inv.astype(np.float32)
