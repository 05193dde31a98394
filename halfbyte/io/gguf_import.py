"""`halfbyte import-gguf`: a llama-architecture GGUF file -> a Hugging Face-style model directory
(dequantized float32 safetensors, config.json, tokenizer.json, tokenizer_config.json,
generation_config.json). Written to a temporary directory and renamed at the end."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from halfbyte.errors import CorruptFileError, HalfbyteError, ModelNotFoundError, UnsupportedModelError
from halfbyte.io.atomic import atomic_directory
from halfbyte.io.gguf_tokenizer import tokenizer_from_gguf

_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


def read_gguf(path: Path) -> Any:
    import gguf

    if not path.is_file():
        raise ModelNotFoundError(f"GGUF file {path} does not exist")
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # the reader raises ValueError, struct/numpy errors on bad input
        raise CorruptFileError(f"{path} is not a valid GGUF file ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
    return reader


def gguf_metadata(reader: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        try:
            meta[key] = field.contents()
        except Exception:  # a field type this gguf version cannot decode: not one we need
            continue
    return meta


def _unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (its rotary pairs interleaved; HF's rotate-half)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _hf_name(name: str) -> str:
    if name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if name == "output_norm.weight":
        return "model.norm.weight"
    if name == "output.weight":
        return "lm_head.weight"
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _NAMES:
        return f"model.layers.{parts[1]}.{_NAMES[parts[2]]}.{parts[3]}"
    raise UnsupportedModelError(f"unexpected GGUF tensor {name!r}")


def _config(meta: dict[str, Any], tied: bool) -> dict[str, Any]:
    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"llama.{key}", default)
        if value is None:
            raise CorruptFileError(f"GGUF metadata lacks llama.{key}")
        return value

    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    cfg: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": hidden, "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")), "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(meta.get("llama.rope.dimension_count", hidden // heads)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 2048)),
        "vocab_size": int(meta.get("llama.vocab_size", len(meta.get("tokenizer.ggml.tokens", [])))),
        "tie_word_embeddings": tied, "torch_dtype": "float32",
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"), "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }
    kind = meta.get("llama.rope.scaling.type")
    if kind and kind != "none":
        cfg["rope_scaling"] = {
            "rope_type": "yarn" if kind == "yarn" else "linear",
            "factor": float(meta.get("llama.rope.scaling.factor", 1.0)),
            **({"original_max_position_embeddings": int(meta["llama.rope.scaling.original_context_length"])}
               if "llama.rope.scaling.original_context_length" in meta else {}),
        }
    return cfg


def _tensors(reader: Any, cfg: dict[str, Any], path: Path, show_progress: bool) -> dict[str, torch.Tensor]:
    from gguf.quants import dequantize
    from rich.progress import track

    size = path.stat().st_size
    out: dict[str, torch.Tensor] = {}
    items = track(reader.tensors, description="importing GGUF", transient=True) if show_progress else reader.tensors
    for t in items:
        if int(t.data_offset) + int(t.n_bytes) > size:
            raise CorruptFileError(f"{path} is truncated (tensor {t.name} runs past the end of the file)")
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        try:
            values = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        except (ValueError, NotImplementedError) as e:
            raise CorruptFileError(f"{path}: tensor {t.name} cannot be dequantized ({e})") from None
        w = torch.from_numpy(values.copy())
        if t.name.endswith("attn_q.weight"):
            w = _unpermute(w, cfg["num_attention_heads"])
        elif t.name.endswith("attn_k.weight"):
            w = _unpermute(w, cfg["num_key_value_heads"])
        out[_hf_name(t.name)] = w
    return out


def import_gguf(gguf_path: str | Path, out_dir: str | Path, *, show_progress: bool = False) -> Path:
    path, out = Path(gguf_path), Path(out_dir)
    if out.exists():
        raise HalfbyteError(f"{out} already exists; remove it or choose another output directory")
    reader = read_gguf(path)
    meta = gguf_metadata(reader)
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise UnsupportedModelError(f"GGUF architecture {arch!r} is not supported (only 'llama')")
    names = {t.name for t in reader.tensors}
    cfg = _config(meta, tied="output.weight" not in names)
    tokenizer = tokenizer_from_gguf(meta)
    tensors = _tensors(reader, cfg, path, show_progress)
    tokens = list(meta["tokenizer.ggml.tokens"])

    def token(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    tok_cfg = {
        "bos_token": token("bos"), "eos_token": token("eos"), "unk_token": token("unknown"),
        "pad_token": token("padding"), "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "model_max_length": cfg["max_position_embeddings"],
    }
    if "tokenizer.chat_template" in meta:
        tok_cfg["chat_template"] = meta["tokenizer.chat_template"]
    gen_cfg = {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"]}
    with atomic_directory(out) as tmp:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt", "source": path.name})
        tokenizer.save(str(tmp / "tokenizer.json"))
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        (tmp / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
        (tmp / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2))
    return out
