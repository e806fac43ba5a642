"""Model hyper-parameters, read from a Hugging Face `config.json` dict.

The config is a frozen dataclass so it can be a static argument of `jax.jit`. `from_hf` and
`from_json` take dicts read from files a user hands jspec: every size must be a whole number in
`LIMITS` (so nothing absurd is allocated from it), every factor a finite positive number, the heads
must divide as attention needs; anything else is a JspecError naming the file and the key.
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
# The largest value jspec takes for each size, by config.json key: well above any released
# Llama-family model (Llama 3.1 405B: 126 layers, hidden 16384, MLP 53248, 128 heads, 128k context).
LIMITS = {
    "vocab_size": 2**24,
    "hidden_size": 2**17,
    "intermediate_size": 2**20,
    "num_hidden_layers": 1024,
    "num_attention_heads": 1024,
    "num_key_value_heads": 1024,
    "head_dim": 4096,
    "max_position_embeddings": 2**24,
    "sliding_window": 2**24,
    "original_max_position_embeddings": 2**24,
}
# ModelConfig's fields that are sizes, by the config.json key each comes from.
_SIZE_FIELDS = {"vocab_size": "vocab_size", "hidden_size": "hidden_size", "intermediate_size": "intermediate_size",
                "num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
                "num_kv_heads": "num_key_value_heads", "head_dim": "head_dim",
                "max_position_embeddings": "max_position_embeddings"}
_REQUIRED = object()


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
    def from_hf(cls, hf: dict, source: str = "config.json") -> "ModelConfig":
        """The config of a supported architecture from a config.json dict; a JspecError naming
        `source` (the file it came from) and the key for a missing, mistyped or absurd value."""
        if not isinstance(hf, dict):
            raise JspecError(f"{source} is not a JSON object")
        try:
            return cls._from_hf(hf, source)
        except KeyError as e:  # a field every supported architecture's config.json has
            raise JspecError(f"{source} lacks {e.args[0]!r}") from None

    @classmethod
    def _from_hf(cls, hf: dict, source: str) -> "ModelConfig":
        archs = hf.get("architectures") or []
        model_type = hf.get("model_type") or ""
        if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
            raise JspecError(f"{source}: 'architectures' is {_shown(archs)}; expected a list of class names")
        if not isinstance(model_type, str):
            raise JspecError(f"{source}: 'model_type' is {_shown(model_type)}; expected a name")
        arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None and model_type in SUPPORTED_ARCHITECTURES.values():
            arch = model_type
        if arch is None:
            name = ", ".join(archs) or model_type or "unknown"
            raise JspecError(
                f"unsupported architecture {name}; jspec supports "
                + ", ".join(SUPPORTED_ARCHITECTURES)
            )

        def size(key: str, default=_REQUIRED) -> int:
            value = hf[key] if default is _REQUIRED else hf.get(key)
            return default if value is None else _size(value, key, source)

        heads, hidden = size("num_attention_heads"), size("hidden_size")
        scaling = hf.get("rope_scaling") or hf.get("rope_parameters") or None
        if scaling is not None and not isinstance(scaling, dict):
            raise JspecError(f"{source}: the rope scaling is {_shown(scaling)}; expected an object")
        rope_theta = _positive(hf.get("rope_theta") or (scaling or {}).get("rope_theta") or 10000.0,
                               "rope_theta", source)
        llama3 = None
        kind = scaling and scaling.get("rope_type", scaling.get("type"))
        if kind == "llama3":
            llama3 = (
                _positive(scaling["factor"], "factor", source),
                _positive(scaling["low_freq_factor"], "low_freq_factor", source),
                _positive(scaling["high_freq_factor"], "high_freq_factor", source),
                _size(scaling["original_max_position_embeddings"], "original_max_position_embeddings", source),
            )
            if llama3[2] <= llama3[1]:
                raise JspecError(f"{source}: llama3 rope scaling needs high_freq_factor above low_freq_factor")
        elif kind not in (None, "default"):
            raise JspecError(f"unsupported rope scaling {kind!r}; jspec supports default and llama3")
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        if not all(_whole(t) and t >= 0 for t in eos_ids):
            raise JspecError(f"{source}: 'eos_token_id' is {_shown(eos)}; expected a token id or a list of them")
        max_pos = size("max_position_embeddings", 2048)
        if arch == "mistral" and hf.get("sliding_window") is not None:
            # Full attention equals sliding-window attention only up to the window.
            max_pos = min(max_pos, size("sliding_window"))
        cfg = cls(
            arch=arch,
            vocab_size=size("vocab_size"),
            hidden_size=hidden,
            intermediate_size=size("intermediate_size"),
            num_layers=size("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=size("num_key_value_heads", heads),
            head_dim=size("head_dim", hidden // heads),
            rms_norm_eps=_positive(hf.get("rms_norm_eps", 1e-6), "rms_norm_eps", source),
            rope_theta=rope_theta,
            max_position_embeddings=max_pos,
            tie_word_embeddings=_flag(hf, "tie_word_embeddings", source),
            attention_bias=arch == "qwen2" or _flag(hf, "attention_bias", source),  # Qwen2 always has q/k/v bias
            rope_llama3=llama3,
            eos_token_ids=tuple(int(t) for t in eos_ids),
        )
        if hf.get("head_dim") is None and hidden % heads:
            raise JspecError(f"{source}: num_attention_heads ({heads}) does not divide hidden_size ({hidden})")
        _check_heads(cfg, source)
        return cfg

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict, source: str = "jspec.json") -> "ModelConfig":
        """The config `to_json` wrote, checked as `from_hf` checks a config.json (`source`: the
        file it came from)."""
        fields = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(d, dict):
            raise JspecError(f"{source}: the model config is not a JSON object")
        missing, unknown = sorted(fields - {"rope_llama3", "eos_token_ids"} - d.keys()), sorted(d.keys() - fields)
        if missing or unknown:
            raise JspecError(f"{source}: the model config " + (f"lacks {missing[0]!r}" if missing else
                                                               f"has an unknown key {unknown[0]!r}"))
        d = dict(d)
        for key, hf_key in _SIZE_FIELDS.items():
            d[key] = _size(d[key], key, source, LIMITS[hf_key])
        for key in ("rms_norm_eps", "rope_theta"):
            d[key] = _positive(d[key], key, source)
        for key in ("tie_word_embeddings", "attention_bias"):
            if not isinstance(d[key], bool):
                raise JspecError(f"{source}: {key!r} is {_shown(d[key])}; expected true or false")
        if d["arch"] not in SUPPORTED_ARCHITECTURES.values():
            raise JspecError(f"{source}: 'arch' is {_shown(d['arch'])}; expected one of "
                             + ", ".join(SUPPORTED_ARCHITECTURES.values()))
        llama3, eos = d.get("rope_llama3"), d.get("eos_token_ids") or ()
        if llama3 is not None:
            if not isinstance(llama3, list | tuple) or len(llama3) != 4:
                raise JspecError(f"{source}: 'rope_llama3' is {_shown(llama3)}; expected four numbers")
            d["rope_llama3"] = (*(_positive(x, "rope_llama3", source) for x in llama3[:3]),
                                _size(llama3[3], "rope_llama3", source, LIMITS["original_max_position_embeddings"]))
        if not isinstance(eos, list | tuple) or not all(_whole(t) and t >= 0 for t in eos):
            raise JspecError(f"{source}: 'eos_token_ids' is {_shown(eos)}; expected a list of token ids")
        d["eos_token_ids"] = tuple(int(t) for t in eos)
        cfg = cls(**d)
        _check_heads(cfg, source)
        return cfg


def _check_heads(cfg: ModelConfig, source: str) -> None:
    if cfg.num_heads % cfg.num_kv_heads:
        raise JspecError(f"{source}: the key/value heads ({cfg.num_kv_heads}) do not divide the attention heads "
                         f"({cfg.num_heads})")
    if cfg.head_dim % 2:
        raise JspecError(f"{source}: the head dimension ({cfg.head_dim}) is odd; rotary embeddings need it even")


def _shown(value) -> str:
    """A value as a message quotes it: short, whatever a crafted file holds."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _whole(value) -> bool:
    """An integer, or a float with a whole value (64.0); not a bool."""
    return (isinstance(value, int) and not isinstance(value, bool)) or (isinstance(value, float) and value.is_integer())


def _size(value, key: str, source: str, limit: int | None = None) -> int:
    limit = limit or LIMITS[key]
    if not _whole(value) or not 1 <= value <= limit:
        raise JspecError(f"{source}: {key!r} is {_shown(value)}; expected a whole number from 1 to {limit}")
    return int(value)


def _positive(value, key: str, source: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
        raise JspecError(f"{source}: {key!r} is {_shown(value)}; expected a finite positive number")
    return float(value)


def _flag(hf: dict, key: str, source: str) -> bool:
    value = hf.get(key)
    if value is not None and not isinstance(value, bool):
        raise JspecError(f"{source}: {key!r} is {_shown(value)}; expected true or false")
    return bool(value)


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
