"""Rotary position embeddings and their context-extension schemes (scaling types).

Each type changes the inverse frequencies (and, for YaRN, an attention scale on cos/sin) with
the same meaning as transformers' ROPE_INIT_FUNCTIONS; tests compare the two."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from halfbyte.errors import InvalidParameterError, UnsupportedModelError

ROPE_TYPES = ("default", "linear", "ntk", "dynamic", "yarn", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    type: str = "default"
    factor: float = 1.0
    alpha: float = 1.0  # static NTK-aware: base' = base * alpha ** (d / (d - 2)) (exllamav2's alpha_value)
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    attention_factor: float | None = None  # yarn
    truncate: bool = True  # yarn

    def __post_init__(self) -> None:
        if self.type not in ROPE_TYPES:
            raise InvalidParameterError(f"rope scaling type must be one of {', '.join(ROPE_TYPES)}; got {self.type!r}")
        if self.type in ("linear", "dynamic", "yarn", "llama3") and not self.factor >= 1.0:
            raise InvalidParameterError(f"rope scaling factor must be >= 1, got {self.factor!r}")
        if not self.alpha > 0:
            raise InvalidParameterError(f"rope scaling alpha must be > 0, got {self.alpha!r}")
        if self.type in ("yarn", "llama3") and not self.original_max_position_embeddings:
            raise InvalidParameterError(f"{self.type} rope scaling needs original_max_position_embeddings")
        if self.type == "llama3" and not self.high_freq_factor > self.low_freq_factor > 0:
            raise InvalidParameterError("llama3 rope scaling needs high_freq_factor > low_freq_factor > 0")

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> RopeScaling:
        """From a config.json dict: transformers 4's `rope_scaling` or 5's `rope_parameters`."""
        params = config.get("rope_scaling") or config.get("rope_parameters") or {}
        if not isinstance(params, dict):
            raise UnsupportedModelError(f"rope_scaling must be an object, got {params!r}")
        kind = params.get("rope_type") or params.get("type") or "default"
        if kind not in ROPE_TYPES or kind == "ntk":
            raise UnsupportedModelError(f"unsupported rope scaling type {kind!r}")
        names = {f.name for f in fields(cls)} - {"type"}
        values = {k: v for k, v in params.items() if k in names and v is not None}
        return cls(type=kind, **values)

    @classmethod
    def parse(cls, spec: str) -> RopeScaling:
        """CLI form: 'none', 'linear:factor=2', 'ntk:alpha=2.5', 'yarn:factor=4,original_max_position_embeddings=8192'."""
        kind, _, rest = spec.strip().partition(":")
        kind = {"none": "default", "ntk-aware": "ntk"}.get(kind, kind)
        if kind not in ROPE_TYPES:
            raise InvalidParameterError(f"rope scaling type must be one of none, {', '.join(ROPE_TYPES[1:])}; got {kind!r}")
        types = {f.name: f.type for f in fields(cls)}
        values: dict[str, Any] = {}
        for item in filter(None, (p.strip() for p in rest.split(","))):
            key, eq, raw = item.partition("=")
            if not eq or key not in types or key == "type":
                raise InvalidParameterError(f"bad rope scaling field {item!r} (fields: {', '.join(k for k in types if k != 'type')})")
            try:
                if key == "truncate":
                    values[key] = raw.lower() in ("1", "true", "yes")
                elif key == "original_max_position_embeddings":
                    values[key] = int(raw)
                else:
                    values[key] = float(raw)
            except ValueError:
                raise InvalidParameterError(f"rope scaling {key} must be a number, got {raw!r}") from None
        return cls(type=kind, **values)

    def to_hf(self) -> dict[str, Any] | None:
        if self.type == "default":
            return None
        out: dict[str, Any] = {"rope_type": self.type, "factor": self.factor}
        defaults = RopeScaling()
        for f in fields(self):
            if f.name not in ("type", "factor") and getattr(self, f.name) != getattr(defaults, f.name):
                out[f.name] = getattr(self, f.name)
        return out

    def with_factor(self, factor: float) -> RopeScaling:
        return replace(self, factor=factor)


def _default_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def rope_frequencies(
    scaling: RopeScaling, head_dim: int, base: float, max_position_embeddings: int, seq_len: int | None = None
) -> tuple[torch.Tensor, float]:
    """(inv_freq float32 [head_dim // 2], attention_scaling) for the given scaling."""
    dim = head_dim
    kind = scaling.type
    if kind == "default":
        return _default_inv_freq(base, dim), 1.0
    if kind == "linear":
        return _default_inv_freq(base, dim) / scaling.factor, 1.0
    if kind == "ntk":
        return _default_inv_freq(base * scaling.alpha ** (dim / (dim - 2)), dim), 1.0
    if kind == "dynamic":
        # frequencies stretch only once the sequence outgrows the trained window
        length = max(seq_len or max_position_embeddings, max_position_embeddings)
        f = scaling.factor
        scaled_base = base * ((f * length / max_position_embeddings) - (f - 1)) ** (dim / (dim - 2))
        return _default_inv_freq(scaled_base, dim), 1.0
    if kind == "llama3":
        return _llama3_inv_freq(scaling, base, dim), 1.0
    return _yarn_inv_freq(scaling, base, dim)


def _llama3_inv_freq(s: RopeScaling, base: float, dim: int) -> torch.Tensor:
    inv_freq = _default_inv_freq(base, dim)
    old_len = s.original_max_position_embeddings or 1
    low_wavelen = old_len / s.low_freq_factor
    high_wavelen = old_len / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_inv_freq(s: RopeScaling, base: float, dim: int) -> tuple[torch.Tensor, float]:
    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = s.attention_factor
    if attention is None:
        if s.mscale and s.mscale_all_dim:
            attention = mscale(s.factor, s.mscale) / mscale(s.factor, s.mscale_all_dim)
        else:
            attention = mscale(s.factor)
    orig = s.original_max_position_embeddings or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (s.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention)


class RotaryEmbedding:
    """cos/sin tables for positions, in the "rotate half" layout ([..., head_dim], halves
    duplicated), times the scaling's attention factor. Static types gather from a table that
    grows (doubling) with the longest sequence seen; dynamic NTK recomputes from the current
    sequence length as transformers does, so every token of a step uses the same frequencies."""

    def __init__(
        self, scaling: RopeScaling, head_dim: int, base: float, max_position_embeddings: int,
        device: torch.device | str, dtype: torch.dtype,
    ) -> None:
        self.scaling = scaling
        self.head_dim = head_dim
        self.base = base
        self.max_position_embeddings = max_position_embeddings
        self.device = torch.device(device)
        self.dtype = dtype
        self._cos = self._sin = torch.empty(0)
        self._len = 0
        if scaling.type != "dynamic":
            inv_freq, self._attention = rope_frequencies(scaling, head_dim, base, max_position_embeddings)
            self._inv_freq = inv_freq.to(self.device)
            self._grow(min(max_position_embeddings, 4096))

    def _table(self, inv_freq: torch.Tensor, positions: torch.Tensor, attention: float) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions.float().unsqueeze(-1) * inv_freq
        emb = torch.cat((angles, angles), dim=-1)
        return (emb.cos() * attention).to(self.dtype), (emb.sin() * attention).to(self.dtype)

    def _grow(self, length: int) -> None:
        new_len = max(length, 2 * self._len)
        positions = torch.arange(new_len, device=self.device)
        self._cos, self._sin = self._table(self._inv_freq, positions, self._attention)
        self._len = new_len

    def cos_sin(self, positions: torch.Tensor, seq_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> (cos, sin) [T, head_dim]. seq_len: the longest sequence in the batch
        (host int; sizes the table without a device sync)."""
        if self.scaling.type == "dynamic":
            inv_freq, attention = rope_frequencies(
                self.scaling, self.head_dim, self.base, self.max_position_embeddings, seq_len
            )
            return self._table(inv_freq.to(self.device), positions, attention)
        if seq_len is not None and seq_len > self._len:
            self._grow(seq_len)
        return self._cos[positions], self._sin[positions]
