"""GGUF import against transformers' own GGUF loader, on the real default model and on small
files written here with gguf.GGUFWriter."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from halfbyte.errors import CorruptFileError, ModelNotFoundError, UnsupportedModelError
from halfbyte.io.default_model import default_gguf_path
from halfbyte.io.gguf_import import import_gguf
from halfbyte.io.tokenizer import Tokenizer

TEXTS = [
    "Hello world! How are you today?",
    "  leading spaces and\ttabs\nnew lines",
    "def add(a, b):\n    return a + b  # code",
    "Ünïcödé, 漢字, emoji 🦙🚀 and accents: café",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n",
]


@pytest.fixture(scope="module")
def hf_tokenizer(default_model_dir: Path):  # type: ignore[no-untyped-def]
    transformers = pytest.importorskip("transformers")
    path = default_gguf_path()
    return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def test_config_matches_metadata(default_model_dir: Path) -> None:
    cfg = json.loads((default_model_dir / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (30, 576, 9, 3)
    assert cfg["vocab_size"] == 49152 and cfg["rope_theta"] == 100000.0 and cfg["tie_word_embeddings"] is True
    assert "chat_template" in json.loads((default_model_dir / "tokenizer_config.json").read_text())


def test_weights_equal_transformers_gguf_loading(default_model_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    path = default_gguf_path()
    hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, torch_dtype=torch.float32)
    ours = load_file(default_model_dir / "model.safetensors")
    ref = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}  # tied
    assert set(ours) == set(ref)
    for name, tensor in ref.items():
        assert torch.equal(ours[name], tensor), name


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_equals_transformers(default_model_dir: Path, hf_tokenizer, text: str) -> None:  # type: ignore[no-untyped-def]
    ours = Tokenizer(default_model_dir)
    ids = ours.encode(text)
    assert ids == hf_tokenizer.encode(text, add_special_tokens=False)
    assert ours.decode(ids, skip_special_tokens=False) == text


def test_digits_split_one_by_one_like_llama_cpp(default_model_dir: Path) -> None:
    """The GGUF's pre-tokenizer is "smollm": llama.cpp splits digits individually (as the
    original SmolLM2 tokenizer does); transformers' GGUF converter does not."""
    tok = Tokenizer(default_model_dir)
    ids = tok.encode("12345")
    assert [tok.decode([i]) for i in ids] == list("12345")


def _write_gguf(path: Path, arch: str = "llama", vocab: int = 64, hidden: int = 32, heads: int = 4, kv_heads: int = 2) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(48)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    tokens = [bytes([0x21 + i]).decode("latin-1") for i in range(vocab - 2)] + ["<s>", "</s>"]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([1] * (vocab - 2) + [3, 3])
    w.add_token_merges([])
    w.add_bos_token_id(vocab - 2)
    w.add_eos_token_id(vocab - 1)
    arrays = {
        "token_embd.weight": rng.standard_normal((vocab, hidden), dtype=np.float32),
        "output_norm.weight": rng.standard_normal(hidden, dtype=np.float32),
        "blk.0.attn_norm.weight": rng.standard_normal(hidden, dtype=np.float32),
        "blk.0.ffn_norm.weight": rng.standard_normal(hidden, dtype=np.float32),
        "blk.0.attn_q.weight": rng.standard_normal((hidden, hidden), dtype=np.float32),
        "blk.0.attn_k.weight": rng.standard_normal((hidden // heads * kv_heads, hidden), dtype=np.float32),
        "blk.0.attn_v.weight": rng.standard_normal((hidden // heads * kv_heads, hidden), dtype=np.float32),
        "blk.0.attn_output.weight": rng.standard_normal((hidden, hidden), dtype=np.float32),
        "blk.0.ffn_gate.weight": rng.standard_normal((48, hidden), dtype=np.float32),
        "blk.0.ffn_up.weight": rng.standard_normal((48, hidden), dtype=np.float32),
        "blk.0.ffn_down.weight": rng.standard_normal((hidden, 48), dtype=np.float32),
    }
    for name, a in arrays.items():
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return arrays


def test_small_gguf_round_trips_through_transformers(tmp_path: Path) -> None:
    """A file we control: our import and transformers' GGUF loader agree on every tensor,
    which pins down the q/k un-permutation."""
    transformers = pytest.importorskip("transformers")
    src = tmp_path / "tiny.gguf"
    _write_gguf(src)
    out = import_gguf(src, tmp_path / "out")
    ours = load_file(out / "model.safetensors")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="tiny.gguf", torch_dtype=torch.float32)
    for name, tensor in hf.state_dict().items():
        if name == "lm_head.weight":
            continue
        assert torch.equal(ours[name], tensor), name


def test_errors_are_clear_and_leave_nothing(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        import_gguf(tmp_path / "missing.gguf", tmp_path / "o1")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(CorruptFileError, match="not a valid GGUF"):
        import_gguf(junk, tmp_path / "o2")
    good = tmp_path / "good.gguf"
    _write_gguf(good)
    data = good.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 2000])
    with pytest.raises(CorruptFileError):
        import_gguf(cut, tmp_path / "o3")
    other = tmp_path / "gpt2.gguf"
    _write_gguf(other, arch="gpt2")
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        import_gguf(other, tmp_path / "o4")
    leftovers = [p.name for p in tmp_path.iterdir() if p.is_dir()]
    assert leftovers == [], leftovers
