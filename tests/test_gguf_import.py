"""GGUF import against transformers' own GGUF loader: on the real default model, and on small
files written here with gguf.GGUFWriter where every value is under the test's control."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer as RustTokenizer

from halfbyte.errors import CorruptFileError, HalfbyteError, ModelNotFoundError, UnsupportedModelError
from halfbyte.io import gguf_import as gi
from halfbyte.io.atomic import atomic_directory
from halfbyte.io.default_model import default_gguf_path
from halfbyte.io.gguf_import import import_gguf
from halfbyte.io.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello world! How are you today?",
    "12345",
    "pi is 3.14159, the year 2024, 1,000,000 items",
    "  leading spaces and\ttabs\nnew lines\n\n",
    " I'm sure they'll say it's DONE",
    "def add(a, b):\n    return a + b  # code",
    "Ünïcödé, 漢字, Привет, emoji 🦙🚀 and accents: café",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>",
    "",
]


# ---------------------------------------------------------------- the real default model


@pytest.fixture(scope="module")
def gguf_tokenizer(default_model_dir: Path) -> Any:
    path = default_gguf_path()
    return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def test_config_matches_metadata(default_model_dir: Path) -> None:
    cfg = json.loads((default_model_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (30, 576, 9, 3)
    assert (cfg["head_dim"], cfg["intermediate_size"], cfg["max_position_embeddings"]) == (64, 1536, 8192)
    assert cfg["vocab_size"] == 49152 and cfg["rope_theta"] == 100000.0 and cfg["tie_word_embeddings"] is True
    assert math.isclose(cfg["rms_norm_eps"], 1e-5, rel_tol=1e-6) and "rope_scaling" not in cfg
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (1, 2)
    assert json.loads((default_model_dir / "generation_config.json").read_text()) == {"bos_token_id": 1, "eos_token_id": 2}


def test_tokenizer_config_has_chat_template_and_special_tokens(default_model_dir: Path) -> None:
    tok_cfg = json.loads((default_model_dir / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tok_cfg["chat_template"]
    assert (tok_cfg["bos_token"], tok_cfg["eos_token"], tok_cfg["add_bos_token"]) == ("<|im_start|>", "<|im_end|>", False)
    assert tok_cfg["model_max_length"] == 8192


def test_weights_equal_transformers_gguf_loading(default_model_dir: Path) -> None:
    path = default_gguf_path()
    hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    ours = load_file(default_model_dir / "model.safetensors")
    ref = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}  # tied to the embedding
    assert set(ours) == set(ref)
    for name, tensor in ref.items():
        assert ours[name].dtype == torch.float32 and torch.equal(ours[name], tensor), name


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_equals_transformers(default_model_dir: Path, gguf_tokenizer: Any, text: str) -> None:
    ours = RustTokenizer.from_file(str(default_model_dir / "tokenizer.json"))
    ids = ours.encode(text, add_special_tokens=False).ids
    assert ids == gguf_tokenizer.encode(text, add_special_tokens=False)
    assert ours.decode(ids, skip_special_tokens=False) == text
    assert Tokenizer(default_model_dir).encode(text) == ids  # halfbyte's wrapper: no BOS for this model


def test_transformers_loads_the_imported_directory(default_model_dir: Path, gguf_tokenizer: Any) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(default_model_dir)
    for text in TEXTS:
        assert tok.encode(text) == gguf_tokenizer.encode(text)
    config = transformers.AutoConfig.from_pretrained(default_model_dir)
    assert (config.num_hidden_layers, config.num_key_value_heads, config.tie_word_embeddings) == (30, 3, True)


def test_digits_split_one_by_one_like_llama_cpp(default_model_dir: Path) -> None:
    """The GGUF's pre-tokenizer is "smollm": llama.cpp splits every digit, as SmolLM2's own
    tokenizer does (the synthetic test below shows where transformers' GGUF reading differs)."""
    tok = RustTokenizer.from_file(str(default_model_dir / "tokenizer.json"))
    assert tok.encode("x 12345").tokens == ["x", "Ġ", "1", "2", "3", "4", "5"]


def test_truncated_real_gguf_is_corrupt(tmp_path: Path) -> None:
    data = default_gguf_path().read_bytes()
    cut = tmp_path / "half.gguf"
    cut.write_bytes(data[: len(data) // 2])
    del data
    with pytest.raises(CorruptFileError, match="truncated") as err:
        import_gguf(cut, tmp_path / "out")
    assert "\n" not in str(err.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["half.gguf"]


# ---------------------------------------------------------------- small files written here

BYTES = [chr(c) for c in range(0x21, 0x7F)] + [chr(c) for c in range(0xA1, 0xAD)] + [chr(c) for c in range(0xAE, 0x100)]
BYTES += [chr(0x100 + i) for i in range(256 - len(BYTES))]  # GPT-2's stand-ins for the other bytes
BPE_MERGES = ["Ġ t", "h e", "Ġt he", "Ġ a", "i n", "in g", "1 2", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld"]
BPE_SPECIAL = ["<|bos|>", "<|eos|>", "<think>"]


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's converter does to q/k rows (written here independently of the import)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path: Path, *, arch: str = "llama", hidden: int = 32, heads: int = 4, kv_heads: int = 2,
               ffn: int = 48, layers: int = 2, tokenizer: str = "gpt2", pre: str = "gpt-2", tied: bool = False,
               meta: dict[str, Any] | None = None, extra: dict[str, np.ndarray] | None = None,
               theta: float = 10000.0, declared_ffn: int | None = None, context: int = 128) -> dict[str, np.ndarray]:
    """A tiny llama GGUF with random F32 weights; returns the weights in transformers' layout."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(layers)
    w.add_context_length(context)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(declared_ffn or ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(theta)
    if tokenizer == "gpt2":
        tokens = BYTES + [m.replace(" ", "") for m in BPE_MERGES] + BPE_SPECIAL
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_types([1] * (len(tokens) - 3) + [3, 3, 4])
        w.add_token_merges(BPE_MERGES)
        w.add_bos_token_id(len(tokens) - 3)
        w.add_eos_token_id(len(tokens) - 2)
        w.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    else:
        tokens, scores, types = spm_vocab()
        w.add_tokenizer_model(tokenizer)
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
    for key, value in (meta or {}).items():
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        else:
            w.add_float32(key, value)
    vocab, head_dim = len(tokens), hidden // heads
    hf = {"model.embed_tokens.weight": rng.standard_normal((vocab, hidden), dtype=np.float32),
          "model.norm.weight": rng.standard_normal(hidden, dtype=np.float32)}
    names = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}
    if not tied:
        hf["lm_head.weight"] = rng.standard_normal((vocab, hidden), dtype=np.float32)
        names["output.weight"] = "lm_head.weight"
    shapes = {"attn_norm": (hidden,), "ffn_norm": (hidden,), "attn_q": (heads * head_dim, hidden),
              "attn_k": (kv_heads * head_dim, hidden), "attn_v": (kv_heads * head_dim, hidden),
              "attn_output": (hidden, heads * head_dim), "ffn_gate": (ffn, hidden), "ffn_up": (ffn, hidden),
              "ffn_down": (hidden, ffn)}
    for i in range(layers):
        for short, shape in shapes.items():
            name = f"model.layers.{i}.{gi._LAYER_NAMES[short]}.weight"
            hf[name] = rng.standard_normal(shape, dtype=np.float32)
            names[f"blk.{i}.{short}.weight"] = name
    for gguf_name, hf_name in names.items():
        data = hf[hf_name]
        if ".attn_q." in gguf_name:
            data = llama_cpp_permute(data, heads)
        elif ".attn_k." in gguf_name:
            data = llama_cpp_permute(data, kv_heads)
        w.add_tensor(gguf_name, data)
    for name, data in (extra or {}).items():
        w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


def spm_vocab() -> tuple[list[str], list[float], list[int]]:
    """A small sentencepiece-style vocabulary: <unk> <s> </s>, 256 byte pieces, then pieces
    scored so that longer ones win."""
    pieces = ["▁", *"abcdefghijklmnopqrstuvwxyz", "▁t", "he", "▁the", "▁a", "in", "ing", "▁w", "or", "▁wor", "ld",
              "▁world", "▁is", "is", "▁s", "▁th", "▁in"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))][::-1]
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    return tokens, scores, types


def _one_line_and_no_leftovers(err: pytest.ExceptionInfo[Any], parent: Path, allowed: set[str]) -> None:
    assert "\n" not in str(err.value) and str(err.value)
    assert {p.name for p in parent.iterdir()} <= allowed  # no output, no hidden .partial directory


def test_small_gguf_round_trips_through_transformers(tmp_path: Path) -> None:
    """Every tensor equals both the weights written (through llama.cpp's permutation and back)
    and what transformers' GGUF loader reads; transformers also loads our directory."""
    src = tmp_path / "tiny.gguf"
    written = write_gguf(src)
    out = import_gguf(src, tmp_path / "out")
    ours = load_file(out / "model.safetensors")
    assert set(ours) == set(written)
    for name, array in written.items():
        assert torch.equal(ours[name], torch.from_numpy(array)), name
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="tiny.gguf", dtype=torch.float32)
    ref = hf.state_dict()
    for name, tensor in ours.items():
        assert torch.equal(tensor, ref[name]), name
    mine = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = torch.tensor([[5, 17, 200, 3, 42]])
    assert torch.equal(mine(ids).logits, hf(ids).logits)


def test_permutation_matters(tmp_path: Path) -> None:
    """Guards the test above against a permutation that is the identity on its shapes."""
    q = np.arange(32 * 4, dtype=np.float32).reshape(32, 4)
    assert not np.array_equal(llama_cpp_permute(q, 4), q)
    assert np.array_equal(gi.unpermute_qk(llama_cpp_permute(q, 4), 4), q)


def test_tied_embeddings_have_no_lm_head(tmp_path: Path) -> None:
    write_gguf(tmp_path / "tied.gguf", tied=True)
    out = import_gguf(tmp_path / "tied.gguf", tmp_path / "out")
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    assert "lm_head.weight" not in load_file(out / "model.safetensors")


BPE_TEXTS = ["the world is 12 wording", " the  thing\n\n12345 ", "<|bos|>the<think>world<|eos|>", "café 🦙"]


@pytest.mark.parametrize("pre", ["gpt-2", "llama-bpe", "smollm"])
def test_small_bpe_tokenizer_against_transformers(tmp_path: Path, pre: str) -> None:
    write_gguf(tmp_path / "t.gguf", pre=pre)
    out = import_gguf(tmp_path / "t.gguf", tmp_path / "out")
    ours = RustTokenizer.from_file(str(out / "tokenizer.json"))
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="t.gguf")
    for text in BPE_TEXTS:
        ids = ours.encode(text, add_special_tokens=False).ids
        assert ours.decode(ids, skip_special_tokens=False) == text
        if pre == "smollm":  # llama.cpp splits digits first; transformers' GGUF reading does not
            assert "12" not in ours.encode(text).tokens
            continue
        assert ids == ref.encode(text, add_special_tokens=False), text
    # <think> is user-defined: matched whole but not special; the control tokens are special
    assert ours.decode(ours.encode("<|bos|>a<think>b").ids, skip_special_tokens=True) == "a<think>b"
    assert "chat_template" in json.loads((out / "tokenizer_config.json").read_text())


def test_small_sentencepiece_tokenizer_against_transformers(tmp_path: Path) -> None:
    write_gguf(tmp_path / "spm.gguf", tokenizer="llama")
    out = import_gguf(tmp_path / "spm.gguf", tmp_path / "out")
    ours = RustTokenizer.from_file(str(out / "tokenizer.json"))
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="spm.gguf")
    for text in ["the world is in the thing", "  the   world\n", "Zebra ünï 12", "<s>the</s>"]:
        ids = ours.encode(text).ids
        assert ids == ref.encode(text), text  # BOS added by both (add_bos_token defaults on for "llama")
        assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ref.encode(text), skip_special_tokens=True)
    tok_cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert (tok_cfg["bos_token"], tok_cfg["unk_token"], tok_cfg["add_bos_token"]) == ("<s>", "<unk>", True)


def test_rope_scaling_metadata(tmp_path: Path) -> None:
    write_gguf(tmp_path / "lin.gguf", meta={"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.0})
    cfg = json.loads((import_gguf(tmp_path / "lin.gguf", tmp_path / "lin") / "config.json").read_text())
    assert cfg["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}
    write_gguf(tmp_path / "yarn.gguf", meta={"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0,
                                             "llama.rope.scaling.original_context_length": 32})
    cfg = json.loads((import_gguf(tmp_path / "yarn.gguf", tmp_path / "yarn") / "config.json").read_text())
    assert cfg["rope_scaling"] == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    assert transformers.AutoConfig.from_pretrained(tmp_path / "yarn").rope_parameters["rope_type"] == "yarn"
    write_gguf(tmp_path / "lr.gguf", meta={"llama.rope.scaling.type": "longrope"})
    with pytest.raises(UnsupportedModelError, match="longrope") as err:
        import_gguf(tmp_path / "lr.gguf", tmp_path / "lr")
    _one_line_and_no_leftovers(err, tmp_path, {"lin.gguf", "lin", "yarn.gguf", "yarn", "lr.gguf"})


@pytest.mark.parametrize("params", [(8.0, 1.0, 4.0, 8192), (32.0, 1.0, 4.0, 8192), (16.0, 2.0, 8.0, 4096)])
def test_llama3_rope_freqs_become_rope_scaling(tmp_path: Path, params: tuple[float, float, float, int]) -> None:
    """Llama 3.x GGUFs carry their rope scaling as a rope_freqs tensor (divisors of the base
    frequencies). The config we write must give transformers the same frequencies."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    factor, low, high, orig = params
    head_dim, theta = 128, 500000.0
    hf_scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
                  "original_max_position_embeddings": orig, "rope_theta": theta}
    ref_cfg = transformers.LlamaConfig(hidden_size=256, num_attention_heads=2, head_dim=head_dim,
                                       max_position_embeddings=131072, rope_parameters=hf_scaling)
    ref_inv, _ = ROPE_INIT_FUNCTIONS["llama3"](ref_cfg, "cpu")
    # what llama.cpp's converter stores: per-frequency divisors, from float32 base frequencies
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    divisors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < orig / high:
            divisors.append(1.0)
        elif wavelen > orig / low:
            divisors.append(factor)
        else:
            smooth = (orig / wavelen - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    rope_freqs = np.array(divisors, dtype=np.float32)
    write_gguf(tmp_path / "l3.gguf", hidden=256, heads=2, kv_heads=1, layers=1, theta=theta, context=131072,
               extra={"rope_freqs.weight": rope_freqs})
    out = import_gguf(tmp_path / "l3.gguf", tmp_path / "out")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["rope_scaling"]["rope_type"] == "llama3" and cfg["rope_scaling"]["factor"] == factor
    ours_inv, _ = ROPE_INIT_FUNCTIONS["llama3"](transformers.AutoConfig.from_pretrained(out), "cpu")
    torch.testing.assert_close(ours_inv, ref_inv, rtol=1e-6, atol=0)
    assert "rope_freqs.weight" not in load_file(out / "model.safetensors")


def test_errors_are_one_line_and_leave_nothing(tmp_path: Path) -> None:
    allowed = set()

    def expect(error: type[HalfbyteError], src: Path, match: str) -> None:
        with pytest.raises(error, match=match) as err:
            import_gguf(src, tmp_path / "out")
        _one_line_and_no_leftovers(err, tmp_path, allowed)

    expect(ModelNotFoundError, tmp_path / "missing.gguf", "does not exist")
    for name, data in {"junk.gguf": b"not a gguf file at all" * 10, "empty.gguf": b""}.items():
        (tmp_path / name).write_bytes(data)
        allowed.add(name)
        expect(CorruptFileError, tmp_path / name, "not a GGUF file")
    write_gguf(tmp_path / "good.gguf")
    allowed.add("good.gguf")
    data = (tmp_path / "good.gguf").read_bytes()
    for name, cut in {"head.gguf": 100, "tail.gguf": len(data) - 8, "half.gguf": len(data) // 2}.items():
        (tmp_path / name).write_bytes(data[:cut])
        allowed.add(name)
        expect(CorruptFileError, tmp_path / name, "truncated")
    cases: dict[str, tuple[dict[str, Any], type[HalfbyteError], str]] = {
        "gpt2.gguf": ({"arch": "gpt2"}, UnsupportedModelError, "architecture 'gpt2'"),
        "bert.gguf": ({"tokenizer": "bert"}, UnsupportedModelError, "tokenizer model 'bert'"),
        "pre.gguf": ({"pre": "qwen2"}, UnsupportedModelError, "pre-tokenizer 'qwen2'"),
        "shape.gguf": ({"declared_ffn": 64}, CorruptFileError, "has shape"),
        "extra.gguf": ({"extra": {"blk.0.attn_q.bias": np.zeros(32, np.float32)}}, UnsupportedModelError, "attn_q.bias"),
    }
    for name, (kwargs, error, match) in cases.items():
        write_gguf(tmp_path / name, **kwargs)
        allowed.add(name)
        expect(error, tmp_path / name, match)


def test_failed_write_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_gguf(tmp_path / "t.gguf")

    def fail(*args: Any, **kwargs: Any) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(gi.json, "dumps", fail)  # fails after model.safetensors is written
    with pytest.raises(OSError):
        import_gguf(tmp_path / "t.gguf", tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.gguf"]


def test_existing_output_directory(tmp_path: Path) -> None:
    write_gguf(tmp_path / "a.gguf")
    write_gguf(tmp_path / "b.gguf", layers=1)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(HalfbyteError, match="already exists") as err:
        import_gguf(tmp_path / "a.gguf", foreign)
    assert "\n" not in str(err.value) and os.listdir(foreign) == ["notes.txt"]
    (tmp_path / "out").mkdir()  # an empty directory is fine
    out = import_gguf(tmp_path / "a.gguf", tmp_path / "out")
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert import_gguf(tmp_path / "a.gguf", out) == out  # an earlier complete import: kept as is
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp
    with pytest.raises(HalfbyteError, match="not an up-to-date import of b.gguf"):
        import_gguf(tmp_path / "b.gguf", out)
    (out / "tokenizer.json").unlink()  # damaged: no longer trusted
    with pytest.raises(HalfbyteError, match="already exists"):
        import_gguf(tmp_path / "a.gguf", out)


def test_concurrent_import_of_the_same_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another process finishing the same import first: ours gives way and returns its result."""
    write_gguf(tmp_path / "t.gguf")
    out = tmp_path / "out"
    original = gi._write_safetensors
    calls = []

    def racing(*args: Any, **kwargs: Any) -> None:
        calls.append(1)
        if len(calls) == 1:
            import_gguf(tmp_path / "t.gguf", out)  # the "other process", run to completion first
        original(*args, **kwargs)

    monkeypatch.setattr(gi, "_write_safetensors", racing)
    assert import_gguf(tmp_path / "t.gguf", out) == out and len(calls) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "t.gguf"]


def test_atomic_directory_never_overwrites(tmp_path: Path) -> None:
    target = tmp_path / "t"
    with pytest.raises(FileExistsError):
        with atomic_directory(target) as tmp:
            (tmp / "x").write_text("new")
            target.mkdir()
            (target / "y").write_text("old")
    assert os.listdir(target) == ["y"] and sorted(os.listdir(tmp_path)) == ["t"]
