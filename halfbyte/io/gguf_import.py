"""`halfbyte import-gguf`: a llama-architecture GGUF file -> a Hugging Face-style model directory
(float32 safetensors dequantized with gguf.quants, config.json, tokenizer.json,
tokenizer_config.json, generation_config.json).

Everything is written into a hidden temporary directory beside the output and renamed at the end,
so a killed import never leaves a directory that looks complete. An existing output directory is
refused (an empty one is fine), except an earlier complete import of the same GGUF (same file name and size, recorded in
model.safetensors' metadata with the importer version): that one is returned as it is, which makes
the import idempotent."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from halfbyte.errors import CorruptFileError, HalfbyteError, ModelNotFoundError, UnsupportedModelError
from halfbyte.io.atomic import atomic_directory
from halfbyte.io.gguf_tokenizer import add_bos_default, tokenizer_from_gguf

_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}
_ROPE_FREQS = "rope_freqs.weight"  # llama3 rope scaling, stored as per-frequency divisors
# Recorded in model.safetensors' metadata; raise it when the import's output changes, so that
# caches of older imports (the default model) are refreshed.
IMPORTER_VERSION = "2"
_OUTPUT_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json")


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def open_gguf(path: Path) -> Any:
    """A gguf.GGUFReader over `path`, with the reader's failures turned into one-line errors."""
    import gguf

    if not path.is_file():
        raise ModelNotFoundError(f"GGUF file {path} does not exist")
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise CorruptFileError(f"{path} is not a GGUF file (it does not start with the GGUF magic)")
    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # ValueError/IndexError from numpy views past the end, struct errors, ...
        raise CorruptFileError(f"{path} is truncated or not a valid GGUF file ({_first_line(e)})") from None


def gguf_metadata(reader: Any) -> dict[str, Any]:
    """Every metadata field as a Python value (arrays as lists)."""
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        try:
            meta[key] = field.contents()
        except Exception as e:  # a damaged field: the reader decodes lazily
            raise CorruptFileError(f"GGUF metadata field {key} cannot be read ({_first_line(e)})") from None
    return meta


def _f32(value: Any) -> float:
    """GGUF stores float32: 1e-5 comes back as 9.999999747e-06; write the shortest float32 decimal."""
    return float(str(np.float32(value)))


def hf_tensor_name(name: str) -> str:
    """llama.cpp tensor name -> transformers' LlamaForCausalLM name."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    raise UnsupportedModelError(f"unexpected GGUF tensor {name!r} for the llama architecture")


def unpermute_qk(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation. Its converter reorders each head's rows from
    transformers' rotate-half layout (first half, second half) to interleaved pairs (GGML's
    rotary); rows [h, pair, 2] -> [h, 2, pair] restores the halves."""
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_factors(theta: float, dim: int, factor: float, low: float, high: float, orig: int) -> np.ndarray:
    """The rope_freqs tensor llama.cpp's converter writes for a llama3 rope_scaling."""
    wavelen = 2 * np.pi * theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    smooth = (orig / wavelen - low) / (high - low)
    mid = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < orig / high, 1.0, np.where(wavelen > orig / low, factor, mid)).astype(np.float32)


def llama3_scaling_from_rope_freqs(factors: np.ndarray, theta: float, dim: int) -> dict[str, Any] | None:
    """Recover transformers' llama3 rope_scaling from llama.cpp's rope_freqs tensor.

    In the smooth band 1/f = (1-s)/factor + s with s = A/wavelen - B, so a line fit gives A and B.
    Only A = orig/(high-low) and B = low/(high-low) shape the frequencies, so low_freq_factor = 1
    is chosen and the others follow; the result is checked by recomputing the tensor."""
    f = np.asarray(factors, dtype=np.float64).reshape(-1)
    if f.shape[0] != dim // 2:
        raise CorruptFileError(f"GGUF {_ROPE_FREQS} has {f.shape[0]} values, expected {dim // 2}")
    if np.allclose(f, 1.0):
        return None
    factor = round(float(f.max()), 4)
    wavelen = 2 * np.pi * theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    band = (f > 1 + 1e-6) & (f < factor * (1 - 1e-6))
    if band.sum() >= 2 and factor > 1:
        s = (1 / f[band] - 1 / factor) / (1 - 1 / factor)
        slope, intercept = np.polyfit(1 / wavelen[band], s, 1)
        b = -intercept
        if b > 0:
            high = round(1 + 1 / b, 4)
            orig = int(round(slope / b))
            if np.allclose(_llama3_factors(theta, dim, factor, 1.0, high, orig), f, rtol=1e-5, atol=0):
                return {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
                        "high_freq_factor": high, "original_max_position_embeddings": orig}
    raise UnsupportedModelError(f"GGUF {_ROPE_FREQS} does not follow llama3 rope scaling; it cannot be imported")


def _rope_scaling(meta: dict[str, Any]) -> dict[str, Any] | None:
    kind = meta.get("llama.rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind not in ("linear", "yarn"):
        raise UnsupportedModelError(f"GGUF rope scaling type {kind!r} is not supported (linear, yarn)")
    scaling: dict[str, Any] = {"rope_type": kind, "factor": _f32(meta.get("llama.rope.scaling.factor", 1.0))}
    if kind == "yarn":
        renames = {"original_context_length": "original_max_position_embeddings", "yarn_beta_fast": "beta_fast",
                   "yarn_beta_slow": "beta_slow", "attn_factor": "attention_factor"}
        for key, hf_key in renames.items():
            value = meta.get(f"llama.rope.scaling.{key}")
            if value is not None:
                scaling[hf_key] = int(value) if key == "original_context_length" else _f32(value)
    return scaling


def _config(meta: dict[str, Any], shapes: dict[str, tuple[int, ...]], rope_freqs: np.ndarray | None) -> dict[str, Any]:
    def need(key: str) -> Any:
        if f"llama.{key}" not in meta:
            raise CorruptFileError(f"GGUF metadata lacks llama.{key}")
        return meta[f"llama.{key}"]

    heads = int(need("attention.head_count"))
    hidden = int(need("embedding_length"))
    head_dim = int(meta.get("llama.attention.key_length", meta.get("llama.rope.dimension_count", hidden // heads)))
    theta = _f32(meta.get("llama.rope.freq_base", 10000.0))
    if "token_embd.weight" not in shapes:
        raise CorruptFileError("GGUF has no token_embd.weight tensor")
    cfg: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": hidden, "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")), "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get("llama.attention.head_count_kv", heads)), "head_dim": head_dim,
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        "rms_norm_eps": _f32(meta.get("llama.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": theta, "max_position_embeddings": int(meta.get("llama.context_length", 2048)),
        "vocab_size": shapes["token_embd.weight"][0],  # the embedding decides; the tokenizer may list fewer
        "tie_word_embeddings": "output.weight" not in shapes, "torch_dtype": "float32",
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"), "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }
    rope_dim = int(meta.get("llama.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise UnsupportedModelError(f"partial rotary embeddings are not supported (rope dim {rope_dim}, head dim {head_dim})")
    scaling = _rope_scaling(meta)
    if rope_freqs is not None:
        if scaling is not None:
            raise UnsupportedModelError(f"GGUF has both {_ROPE_FREQS} and llama.rope.scaling.type {scaling['rope_type']!r}")
        scaling = llama3_scaling_from_rope_freqs(rope_freqs, theta, head_dim)
    if scaling is not None:
        cfg["rope_scaling"] = scaling
    return cfg


def _expected_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    hidden, inter, hd, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"], cfg["vocab_size"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (vocab, hidden)
    per_layer = {"input_layernorm": (hidden,), "post_attention_layernorm": (hidden,),
                 "self_attn.q_proj": (q, hidden), "self_attn.k_proj": (kv, hidden), "self_attn.v_proj": (kv, hidden),
                 "self_attn.o_proj": (hidden, q), "mlp.gate_proj": (inter, hidden), "mlp.up_proj": (inter, hidden),
                 "mlp.down_proj": (hidden, inter)}
    for i in range(cfg["num_hidden_layers"]):
        shapes.update({f"model.layers.{i}.{name}.weight": shape for name, shape in per_layer.items()})
    return shapes


def _check_tensors(reader: Any, cfg: dict[str, Any], shapes: dict[str, tuple[int, ...]]) -> list[tuple[Any, str]]:
    """(GGUF tensor, HF name) for every weight, after checking names and shapes."""
    expected = _expected_shapes(cfg)
    plan = []
    for t in reader.tensors:
        if t.name == _ROPE_FREQS:
            continue
        name = hf_tensor_name(t.name)
        if name not in expected:  # a bias, or a layer past block_count
            raise UnsupportedModelError(f"unexpected GGUF tensor {t.name!r} for this llama config")
        if expected[name] != shapes[t.name]:
            raise CorruptFileError(f"GGUF tensor {t.name} has shape {list(shapes[t.name])}, expected {list(expected[name])}")
        plan.append((t, name))
    missing = sorted(set(expected) - {name for _, name in plan}, key=lambda n: list(expected).index(n))
    if missing:
        raise CorruptFileError(f"GGUF lacks {len(missing)} tensors the config needs, first {missing[0]}")
    return plan


def _check_bounds(reader: Any, path: Path) -> None:
    size = path.stat().st_size
    for t in reader.tensors:
        if int(t.data_offset) + int(t.n_bytes) > size:
            raise CorruptFileError(f"{path} is truncated (tensor {t.name} runs past the end of the file)")


def _dequantized(t: Any, cfg: dict[str, Any]) -> np.ndarray:
    from gguf.quants import dequantize

    shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # GGUF lists dims innermost first
    try:
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
    except (ValueError, NotImplementedError, TypeError, IndexError) as e:
        raise CorruptFileError(f"GGUF tensor {t.name} ({t.tensor_type.name}) cannot be dequantized ({_first_line(e)})") from None
    if t.name.endswith(".attn_q.weight"):
        w = unpermute_qk(w, cfg["num_attention_heads"])
    elif t.name.endswith(".attn_k.weight"):
        w = unpermute_qk(w, cfg["num_key_value_heads"])
    return np.ascontiguousarray(w, dtype="<f4")


def _write_safetensors(out: BinaryIO, plan: list[tuple[Any, str]], shapes: dict[str, tuple[int, ...]],
                       cfg: dict[str, Any], metadata: dict[str, str], show_progress: bool) -> None:
    """Streams float32 tensors into a safetensors file, one tensor in memory at a time."""
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for t, name in plan:
        nbytes = 4 * int(np.prod(shapes[t.name]))
        header[name] = {"dtype": "F32", "shape": list(shapes[t.name]), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
    out.write(struct.pack("<Q", len(blob)) + blob)
    items: Any = plan
    if show_progress:
        from rich.progress import track

        items = track(plan, description="dequantizing GGUF tensors", transient=True)
    for t, _ in items:
        out.write(_dequantized(t, cfg).data.cast("B"))


def recorded_import(out: Path) -> dict[str, str] | None:
    """What a complete import in `out` records about itself (GGUF name and size, importer
    version); None when `out` is not a complete import."""
    if not all((out / name).is_file() for name in _OUTPUT_FILES):
        return None
    try:
        from safetensors import safe_open

        with safe_open(str(out / "model.safetensors"), "np") as f:
            recorded = f.metadata() or {}
    except Exception:  # unreadable: not an import we can vouch for
        return None
    return recorded if recorded.get("halfbyte_import") == "gguf" else None


def _is_import_of(out: Path, source: dict[str, str]) -> bool:
    recorded = recorded_import(out)
    return recorded is not None and all(recorded.get(k) == v for k, v in source.items())


def _tokenizer_config(meta: dict[str, Any], cfg: dict[str, Any]) -> dict[str, Any]:
    tokens = [str(t) for t in meta["tokenizer.ggml.tokens"]]

    def token(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    tok_cfg: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos"), "eos_token": token("eos"), "unk_token": token("unknown"), "pad_token": token("padding"),
        "add_bos_token": add_bos_default(meta), "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False, "model_max_length": cfg["max_position_embeddings"],
    }
    if meta.get("tokenizer.chat_template"):
        tok_cfg["chat_template"] = str(meta["tokenizer.chat_template"])
    return tok_cfg


def import_gguf(gguf_path: str | Path, out_dir: str | Path, *, show_progress: bool = False) -> Path:
    """Import a llama-architecture GGUF into `out_dir` (a Hugging Face-style directory); returns it."""
    path, out = Path(gguf_path), Path(out_dir)
    reader = open_gguf(path)
    source = {"halfbyte_import": "gguf", "importer_version": IMPORTER_VERSION,
              "gguf_name": path.name, "gguf_bytes": str(path.stat().st_size)}
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):  # an empty directory is replaced
        if _is_import_of(out, source):
            return out
        raise HalfbyteError(f"{out} already exists and is not an up-to-date import of {path.name}; remove it or choose another directory")
    meta = gguf_metadata(reader)
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise UnsupportedModelError(f"GGUF architecture {arch!r} is not supported (only 'llama')")
    _check_bounds(reader, path)
    shapes = {t.name: tuple(int(d) for d in reversed(t.shape.tolist())) for t in reader.tensors}
    by_name = {t.name: t for t in reader.tensors}
    rope_freqs = None
    if _ROPE_FREQS in by_name:
        rope_freqs = _dequantized(by_name[_ROPE_FREQS], {})
    cfg = _config(meta, shapes, rope_freqs)
    plan = _check_tensors(reader, cfg, shapes)
    tokenizer = tokenizer_from_gguf(meta)
    tok_cfg = _tokenizer_config(meta, cfg)
    gen_cfg = {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"]}
    try:
        with atomic_directory(out) as tmp:
            with open(tmp / "model.safetensors", "wb") as f:
                _write_safetensors(f, plan, shapes, cfg, {"format": "pt", **source}, show_progress)
            tokenizer.save(str(tmp / "tokenizer.json"))
            (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
            (tmp / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False) + "\n")
            (tmp / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2) + "\n")
    except FileExistsError:
        if _is_import_of(out, source):  # another process finished the same import first
            return out
        raise HalfbyteError(f"{out} appeared while importing {path.name}; remove it or choose another directory") from None
    return out
