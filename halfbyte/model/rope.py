"""Rotary position embeddings and their context-extension schemes (scaling types).

Each type changes the inverse frequencies (and, for YaRN, a factor on cos/sin) with the same
meaning as transformers' ROPE_INIT_FUNCTIONS; tests/test_rope.py compares the two. The one type
transformers lacks, "ntk", is exllamav2's static NTK-aware alpha: a change of base."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

import torch

from halfbyte.errors import InvalidParameterError, UnsupportedModelError

ROPE_TYPES = ("default", "linear", "ntk", "dynamic", "yarn", "llama3")

# The fields each type reads; any other field must keep its default, so nothing is silently ignored.
TYPE_FIELDS: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "ntk": ("alpha",),
    "dynamic": ("factor", "original_max_position_embeddings"),
    "yarn": (
        "factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
        "mscale", "mscale_all_dim", "attention_factor", "truncate",
    ),
    "llama3": ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"),
}


@dataclass(frozen=True)
class RopeScaling:
    """How RoPE is stretched past the trained context. Defaults are the plain RoPE."""

    type: str = "default"
    factor: float = 1.0
    alpha: float = 1.0  # ntk: base' = base * alpha ** (d / (d - 2)) (exllamav2's alpha_value)
    # dynamic: the length beyond which frequencies stretch (default: the model's max positions);
    # yarn, llama3: the pretraining context length (required)
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    attention_factor: float | None = None  # yarn: overrides the factor derived from factor / mscale
    truncate: bool = True  # yarn: floor/ceil the correction range (transformers' default)

    def __post_init__(self) -> None:
        if self.type not in ROPE_TYPES:
            raise InvalidParameterError(
                f"rope scaling type must be one of {', '.join(ROPE_TYPES)}; got {self.type!r}"
            )
        defaults = _DEFAULTS
        for f in fields(self):
            if f.name != "type" and f.name not in TYPE_FIELDS[self.type]:
                if getattr(self, f.name) != getattr(defaults, f.name):
                    raise InvalidParameterError(
                        f"rope scaling field {f.name} does not apply to type {self.type!r}"
                        f" (its fields: {', '.join(TYPE_FIELDS[self.type]) or 'none'})"
                    )
        for name in ("factor", "alpha", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow"):
            _check_number(name, getattr(self, name))
        for name in ("mscale", "mscale_all_dim", "attention_factor"):
            if getattr(self, name) is not None:
                _check_number(name, getattr(self, name))
        if self.type != "default" and self.type != "ntk" and not self.factor >= 1.0:
            raise InvalidParameterError(f"rope scaling factor must be >= 1, got {self.factor!r}")
        if not self.alpha > 0:
            raise InvalidParameterError(f"rope scaling alpha must be > 0, got {self.alpha!r}")
        orig = self.original_max_position_embeddings
        if orig is not None and (isinstance(orig, bool) or not isinstance(orig, int) or orig <= 0):
            raise InvalidParameterError(
                f"rope scaling original_max_position_embeddings must be a positive integer, got {orig!r}"
            )
        if self.type in ("yarn", "llama3") and orig is None:
            raise InvalidParameterError(f"{self.type} rope scaling needs original_max_position_embeddings")
        if not self.low_freq_factor > 0:
            raise InvalidParameterError(f"rope scaling low_freq_factor must be > 0, got {self.low_freq_factor!r}")
        if not self.high_freq_factor > self.low_freq_factor:
            # equal factors would divide by zero in llama3's smoothing ramp
            raise InvalidParameterError(
                f"rope scaling high_freq_factor ({self.high_freq_factor!r}) must exceed"
                f" low_freq_factor ({self.low_freq_factor!r})"
            )
        for name in ("beta_fast", "beta_slow"):
            if not getattr(self, name) > 0:
                raise InvalidParameterError(f"rope scaling {name} must be > 0, got {getattr(self, name)!r}")
        if self.attention_factor is not None and not self.attention_factor > 0:
            raise InvalidParameterError(
                f"rope scaling attention_factor must be > 0, got {self.attention_factor!r}"
            )
        if not isinstance(self.truncate, bool):
            raise InvalidParameterError(f"rope scaling truncate must be true or false, got {self.truncate!r}")

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> RopeScaling:
        """From a config.json dict: transformers 4's `rope_scaling` (with `type` or `rope_type`)
        or transformers 5's `rope_parameters`. Missing values default as transformers does."""
        params = config.get("rope_scaling") or config.get("rope_parameters") or {}
        if not isinstance(params, dict):
            raise UnsupportedModelError(f"rope_scaling must be an object, got {params!r}")
        kind = params.get("rope_type") or params.get("type") or "default"
        if kind not in ROPE_TYPES:  # "ntk" is ours (to_hf writes it); the rest are transformers' names
            raise UnsupportedModelError(
                f"unsupported rope scaling type {kind!r}; halfbyte runs {', '.join(ROPE_TYPES)}"
            )
        partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor"))
        if partial is not None and float(partial) != 1.0:
            raise UnsupportedModelError(
                f"partial rotary embeddings are not supported (partial_rotary_factor={partial})"
            )
        # dynamic reads only max_position_embeddings in transformers, whatever the dict holds
        wanted = [n for n in TYPE_FIELDS[kind] if (kind, n) != ("dynamic", "original_max_position_embeddings")]
        values = {n: _coerce(n, params[n]) for n in wanted if params.get(n) is not None}
        max_pos = config.get("max_position_embeddings")
        if kind in ("yarn", "llama3"):
            # transformers: a top-level original_max_position_embeddings (Phi-3 style) wins,
            # else the dict's, else max_position_embeddings
            top = config.get("original_max_position_embeddings")
            orig = top if top is not None else params.get("original_max_position_embeddings", max_pos)
            if orig is not None:
                values["original_max_position_embeddings"] = _coerce("original_max_position_embeddings", orig)
        if kind == "yarn" and "factor" not in values and max_pos and values.get("original_max_position_embeddings"):
            # DeepSeek-V3 style: the factor is implied by the two lengths
            values["factor"] = float(max_pos) / values["original_max_position_embeddings"]
        return cls(type=kind, **values)

    @classmethod
    def parse(cls, spec: str) -> RopeScaling:
        """CLI form: 'none', 'linear:factor=2', 'ntk:alpha=2.5', 'dynamic:factor=4',
        'yarn:factor=4,original_max_position_embeddings=8192', 'llama3:factor=8,...'."""
        kind, _, rest = spec.strip().partition(":")
        kind = kind.strip().lower()
        kind = "default" if kind == "none" else kind
        if kind not in ROPE_TYPES:
            raise InvalidParameterError(
                f"unknown rope scaling type {kind!r} in {spec!r}; expected none, {', '.join(ROPE_TYPES[1:])}"
                " (e.g. linear:factor=2)"
            )
        values: dict[str, Any] = {}
        for item in filter(None, (p.strip() for p in rest.split(","))):
            key, eq, raw = (s.strip() for s in item.partition("="))
            if not eq or not key:
                raise InvalidParameterError(f"rope scaling: expected field=value, got {item!r}")
            if key not in TYPE_FIELDS[kind]:
                raise InvalidParameterError(
                    f"rope scaling field {key!r} does not apply to type {kind!r}"
                    f" (its fields: {', '.join(TYPE_FIELDS[kind]) or 'none'})"
                )
            if key in values:
                raise InvalidParameterError(f"rope scaling field {key} given twice")
            values[key] = _coerce(key, raw)
        return cls(type=kind, **values)

    def to_hf(self) -> dict[str, Any] | None:
        """The transformers-4 `rope_scaling` dict (None for plain RoPE); from_hf inverts it.
        "ntk" is halfbyte's own type: transformers cannot read it."""
        if self.type == "default":
            return None
        out: dict[str, Any] = {"rope_type": self.type}
        for name in TYPE_FIELDS[self.type]:
            value = getattr(self, name)
            # transformers requires these keys; the rest only when they differ from the default
            required = name in ("factor", "alpha", "original_max_position_embeddings") or name.endswith("freq_factor")
            if value is not None and (required or value != getattr(_DEFAULTS, name)):
                out[name] = value
        return out


def _check_number(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidParameterError(f"rope scaling {name} must be a finite number, got {value!r}")


def _coerce(name: str, raw: Any) -> Any:
    """A field value from a CLI string or JSON value, or InvalidParameterError naming the field."""
    try:
        if name == "truncate":
            if isinstance(raw, bool):
                return raw
            text = str(raw).strip().lower()
            if text in ("1", "true", "yes"):
                return True
            if text in ("0", "false", "no"):
                return False
            raise ValueError(raw)
        if name == "original_max_position_embeddings":
            if isinstance(raw, float) and raw.is_integer():
                return int(raw)
            if isinstance(raw, bool) or isinstance(raw, float):
                raise ValueError(raw)
            return int(raw)
        if isinstance(raw, bool):
            raise ValueError(raw)
        return float(raw)
    except (TypeError, ValueError):
        kind = "true or false" if name == "truncate" else "an integer" if name.startswith("original") else "a number"
        raise InvalidParameterError(f"rope scaling {name} must be {kind}, got {raw!r}") from None


_DEFAULTS = object.__new__(RopeScaling)  # the field defaults, without running validation
for _f in fields(RopeScaling):
    object.__setattr__(_DEFAULTS, _f.name, _f.default)


def _default_inv_freq(base: float | torch.Tensor, dim: int, device: torch.device | None) -> torch.Tensor:
    # the exact op sequence of transformers, so the floats agree bit for bit: at position 1e4 one
    # ulp of inv_freq moves the angle by ~1e-3
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim))


def rope_frequencies(
    scaling: RopeScaling,
    head_dim: int,
    base: float,
    max_position_embeddings: int,
    seq_len: int | None = None,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, float]:
    """(inv_freq float32 [head_dim // 2], attention_scaling): attention_scaling multiplies cos
    and sin. seq_len matters only to "dynamic", which stretches once it passes the original length."""
    if head_dim < 4 or head_dim % 2:
        raise InvalidParameterError(f"rope head_dim must be an even number >= 4, got {head_dim}")
    dev = torch.device(device) if device is not None else None
    dim, kind = head_dim, scaling.type
    if kind == "default":
        return _default_inv_freq(base, dim, dev), 1.0
    if kind == "linear":
        return _default_inv_freq(base, dim, dev) / scaling.factor, 1.0
    if kind == "ntk":
        return _default_inv_freq(base * scaling.alpha ** (dim / (dim - 2)), dim, dev), 1.0
    if kind == "dynamic":
        return _dynamic_inv_freq(scaling, base, dim, max_position_embeddings, seq_len, dev), 1.0
    if kind == "llama3":
        return _llama3_inv_freq(scaling, base, dim, dev), 1.0
    return _yarn_inv_freq(scaling, base, dim, dev)


def _dynamic_inv_freq(
    s: RopeScaling, base: float, dim: int, max_pos: int, seq_len: int | None, dev: torch.device | None
) -> torch.Tensor:
    original = s.original_max_position_embeddings or max_pos
    if seq_len is None or seq_len <= original:
        return _default_inv_freq(base, dim, dev)  # the formula gives exactly the plain base here
    # transformers computes this base from a tensor seq_len at run time, i.e. in float32 on the
    # device; doing the same keeps cos/sin identical to its LlamaRotaryEmbedding
    length = torch.tensor(seq_len, dtype=torch.int64, device=dev)
    scaled = base * ((s.factor * length / original) - (s.factor - 1)) ** (dim / (dim - 2))
    return _default_inv_freq(scaled, dim, dev)


def _llama3_inv_freq(s: RopeScaling, base: float, dim: int, dev: torch.device | None) -> torch.Tensor:
    inv_freq = _default_inv_freq(base, dim, dev)
    old_len = s.original_max_position_embeddings
    assert old_len is not None  # validated
    low_wavelen = old_len / s.low_freq_factor
    high_wavelen = old_len / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths (low frequencies) are interpolated by factor, short ones kept, the middle
    # band blended by where its wavelength falls between the two bounds
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(s: RopeScaling, base: float, dim: int, dev: torch.device | None) -> tuple[torch.Tensor, float]:
    attention = s.attention_factor
    if attention is None:
        # DeepSeek's form when both mscales are set (truthy, as transformers tests them)
        if s.mscale and s.mscale_all_dim:
            attention = _yarn_mscale(s.factor, s.mscale) / _yarn_mscale(s.factor, s.mscale_all_dim)
        else:
            attention = _yarn_mscale(s.factor)
    orig = s.original_max_position_embeddings
    assert orig is not None  # validated

    def correction_dim(rotations: float) -> float:
        # the dimension whose wavelength turns `rotations` times over the original context
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1).to(device=dev)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(device=dev, dtype=torch.float) / dim)
    extrapolation = 1 - ramp  # 1: keep the frequency (high ones), 0: interpolate by factor
    inv_freq = (1.0 / (s.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention)


class RotaryEmbedding:
    """cos/sin for positions in the "rotate half" layout ([..., head_dim], the halves
    duplicated), computed in float32, times the attention scaling, then cast to dtype.

    A table of cos/sin for positions [0, capacity) lives on the device and doubles when a
    longer sequence comes, so a decode step is a gather. Pass seq_len (a host int, greater than
    every position) to size it without a device sync.

    Dynamic NTK mirrors transformers' LlamaRotaryEmbedding, state included, so outputs match it
    token for token: frequencies are recomputed whenever seq_len exceeds the length they were
    last made for (beyond the original window), kept while it shrinks but stays beyond that
    window, and reset to the plain ones once a call fits inside it. Keys already in a KV cache
    keep the rotation they were stored with (transformers' behaviour too, a known inexactness
    of dynamic NTK with caching). While stretched, cos/sin are computed for the asked positions
    only; the table holds the plain frequencies.
    """

    def __init__(
        self,
        scaling: RopeScaling,
        head_dim: int,
        base: float,
        max_position_embeddings: int,
        device: torch.device | str,
        dtype: torch.dtype,
    ) -> None:
        self.scaling = scaling
        self.head_dim = head_dim
        self.base = base
        self.max_position_embeddings = max_position_embeddings
        self.device = torch.device(device)
        self.dtype = dtype
        # computed on the CPU and moved, as transformers builds its buffer before .to(device)
        inv_freq, self.attention_scaling = rope_frequencies(scaling, head_dim, base, max_position_embeddings)
        self.inv_freq = inv_freq.to(self.device)  # [head_dim // 2], the table's frequencies
        self._cos = torch.empty(0, head_dim, dtype=dtype, device=self.device)  # [capacity, head_dim]
        self._sin = self._cos
        self.original_len = scaling.original_max_position_embeddings or max_position_embeddings
        self._dynamic_len = self.original_len  # transformers' max_seq_len_cached
        self._dynamic_inv_freq: torch.Tensor | None = None  # None: the plain frequencies apply

    @property
    def capacity(self) -> int:
        """Positions the cos/sin table covers now."""
        return self._cos.shape[0]

    def reserve(self, length: int) -> None:
        """Grow the table to cover positions [0, length), doubling (e.g. before CUDA-graph capture)."""
        if length <= self.capacity:
            return
        new_len = max(self.capacity, 64)
        while new_len < length:
            new_len *= 2
        positions = torch.arange(new_len, device=self.device)
        self._cos, self._sin = self._compute(self.inv_freq, self.attention_scaling, positions)

    def _compute(
        self, inv_freq: torch.Tensor, attention: float, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions[..., None].float() * inv_freq  # [*positions, head_dim // 2]
        emb = torch.cat((angles, angles), dim=-1)
        return (emb.cos() * attention).to(self.dtype), (emb.sin() * attention).to(self.dtype)

    def _update_dynamic(self, seq_len: int) -> None:
        if seq_len > self._dynamic_len:  # growth: stretch for this length
            self._dynamic_inv_freq, _ = rope_frequencies(
                self.scaling, self.head_dim, self.base, self.max_position_embeddings, seq_len, self.device
            )
            self._dynamic_len = seq_len
        elif seq_len < self.original_len and self._dynamic_len > self.original_len:  # reset
            self._dynamic_inv_freq = None
            self._dynamic_len = self.original_len

    def cos_sin(self, positions: torch.Tensor, seq_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [*] (integers) -> (cos, sin) [*, head_dim]. seq_len: the longest sequence
        in the batch including cached tokens (default: max(positions) + 1, a device sync)."""
        if seq_len is None:
            seq_len = int(positions.max()) + 1 if positions.numel() else 0
        elif positions.device.type == "cpu" and positions.numel() and int(positions.max()) >= seq_len:
            raise InvalidParameterError(
                f"rope seq_len {seq_len} must exceed every position (max {int(positions.max())})"
            )
        if self.scaling.type == "dynamic":
            self._update_dynamic(seq_len)
            if self._dynamic_inv_freq is not None:
                return self._compute(self._dynamic_inv_freq, self.attention_scaling, positions.to(self.device))
        self.reserve(seq_len)
        return self._cos[positions], self._sin[positions]
