"""Tensor parallelism on the CPU with gloo: tensor_parallel_size 2 and 3 give the single-process
logits (fp32, within 1e-4) and the same greedy output, on SmolLM2, on random dense configs with
uneven splits and KV-head replication, and on a 4-bit model with act-order; bad sizes fail
before any weight is read.

Each engine here spawns N-1 worker processes; the group timeout (HALFBYTE_TP_TIMEOUT) bounds a
hang, and close() joins or terminates the workers even when a test fails."""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from halfbyte.engine.llm_engine import LLMEngine
from halfbyte.engine.scoring import score_tokens
from halfbyte.errors import InvalidParameterError
from halfbyte.quant.qtensor import QuantWeight, concat_out
from halfbyte.quant.rtn import quantize_rtn
from halfbyte.sampling_params import SamplingParams
from tests.tiny_model import TOKENIZER_FILES

os.environ.setdefault("HALFBYTE_TP_TIMEOUT", "60")  # a broken rank fails the test, never hangs CI

FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.down_proj": ("mlp.down_proj",),
}


def make_random_llama(out: Path, tokenizer_from: Path, seed: int = 0, **shape: int | bool) -> Path:
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=49152, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, **shape,
    )
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():  # larger-than-init weights: logits that differ visibly between tokens
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    model.save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (tokenizer_from / name).exists():
            shutil.copy(tokenizer_from / name, out / name)
    return out


def _quantize(w: torch.Tensor, bits: int, group: int, perm: torch.Tensor | None) -> QuantWeight:
    if perm is None:
        return quantize_rtn(w, bits, group)
    q = quantize_rtn(w[:, perm], bits, group)
    return QuantWeight(q.out_features, q.in_features, q.slices, perm.to(torch.int32))


def quantize_dir(src: Path, out: Path, bits: int = 4, group: int = 32, act_order: bool = True, seed: int = 0) -> Path:
    """RTN-quantize every projection into the halfbyte format (act order: a random permutation
    on o_proj and down_proj, whose K is split across ranks)."""
    gen = torch.Generator().manual_seed(seed)
    tensors = load_file(src / "model.safetensors")
    cfg = json.loads((src / "config.json").read_text())
    layers: dict[str, dict] = {}
    for i in range(cfg["num_hidden_layers"]):
        base = f"model.layers.{i}"
        for fused, parts in FUSED.items():
            names = [f"{base}.{p}.weight" for p in parts]
            k = tensors[names[0]].shape[1]
            row_parallel = len(parts) == 1
            perm = torch.randperm(k, generator=gen) if act_order and row_parallel else None
            qws = [_quantize(tensors.pop(n), bits, group, perm) for n in names]
            qw = concat_out(qws) if len(qws) > 1 else qws[0]
            layers[f"{base}.{fused}"] = qw.meta()
            tensors.update(qw.to_state_dict(f"{base}.{fused}"))
    out.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, out / "model.safetensors")
    cfg["quantization"] = {"quant_method": "halfbyte", "format_version": 1, "layers": layers}
    (out / "config.json").write_text(json.dumps(cfg))
    for name in [*TOKENIZER_FILES, "generation_config.json"]:
        if (src / name).exists() and not (out / name).exists():
            shutil.copy(src / name, out / name)
    return out


PROMPTS = [list(range(100, 137)), [5, 900, 77, 4001, 12, 12, 12, 3000], list(range(20000, 20019))]


def _engine(model_dir: Path, tp: int | None) -> LLMEngine:
    return LLMEngine(model_dir, dtype="float32", device="cpu", tensor_parallel_size=tp)


def _greedy(engine: LLMEngine, max_tokens: int = 6) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), p, params)
    out: dict[str, list[int]] = {str(i): [] for i in range(len(PROMPTS))}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    return [out[str(i)] for i in range(len(PROMPTS))]


def _run(model_dir: Path, tp: int | None) -> tuple[torch.Tensor, list[list[int]], list[dict]]:
    """Teacher-forced logits of PROMPTS[0] (chunked prefill: the second chunk reads the first's
    KV pages) and the greedy continuations of all prompts, batched."""
    engine = _engine(model_dir, tp)
    try:
        logits = score_tokens(engine.model, PROMPTS[0], chunk=16)
        greedy = _greedy(engine)
        memory = engine.tp.memory if engine.tp is not None else []
        return logits, greedy, memory
    finally:
        engine.close()


@pytest.fixture(autouse=True)
def _no_leftover_workers() -> Iterator[None]:
    yield
    leftover = [p for p in multiprocessing.active_children() if p.name.startswith("halfbyte-tp-rank")]
    for p in leftover:
        p.terminate()
    assert not leftover, f"worker processes outlived their engine: {leftover}"


def _check_parity(model_dir: Path, sizes: tuple[int, ...]) -> None:
    ref_logits, ref_greedy, _ = _run(model_dir, None)
    assert ref_logits.dtype == torch.float32
    for tp in sizes:
        logits, greedy, memory = _run(model_dir, tp)
        assert (logits - ref_logits).abs().max().item() <= 1e-4, f"tensor_parallel_size {tp}"
        assert greedy == ref_greedy, f"tensor_parallel_size {tp}"
        assert [m["rank"] for m in memory] == list(range(tp))
        assert all(m["weights_bytes"] > 0 and m["kv_cache_bytes"] > 0 for m in memory)


@pytest.fixture(scope="module")
def tokenizer_dir(default_model_dir: Path) -> Path:
    return default_model_dir


# in CI (issue 8 asks for it there): ~60 s on the 2-core box, one SmolLM2 load per run and size
def test_smollm2_tp2_tp3_match_single_process(default_model_dir: Path) -> None:
    # 9 heads / 3 KV heads: size 2 splits the KV groups unevenly (2 + 1), size 3 one group each
    _check_parity(default_model_dir, (2, 3))


def test_random_config_uneven_splits_and_kv_replication(tokenizer_dir: Path, tmp_path: Path) -> None:
    # 6 heads / 2 KV heads: size 3 exceeds the KV heads (each rank: 2 query heads and a KV replica
    # shared with a neighbour); intermediate 100 and vocab split unevenly; biases and untied head
    d = make_random_llama(
        tmp_path / "m", tokenizer_dir, hidden_size=48, intermediate_size=100, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=2, head_dim=8, tie_word_embeddings=False,
        attention_bias=True, mlp_bias=True,
    )
    _check_parity(d, (2, 3))


def test_random_config_with_smollm2_head_layout(tokenizer_dir: Path, tmp_path: Path) -> None:
    # SmolLM2's 9 heads / 3 KV heads at a tiny width (the CI stand-in for the slow test above):
    # size 2 holds KV groups 2 + 1, size 3 one group each
    d = make_random_llama(
        tmp_path / "m", tokenizer_dir, hidden_size=36, intermediate_size=72, num_hidden_layers=2,
        num_attention_heads=9, num_key_value_heads=3, head_dim=4, tie_word_embeddings=True,
    )
    _check_parity(d, (2, 3))


def test_quantized_4bit_with_act_order(tokenizer_dir: Path, tmp_path: Path) -> None:
    # 4-bit, group 32, act-order permutations on o_proj / down_proj: the row-parallel layers run
    # gathered on group boundaries; intermediate 96 cut on group boundaries (2 ranks: 64 + 32)
    src = make_random_llama(
        tmp_path / "dense", tokenizer_dir, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
    )
    _check_parity(quantize_dir(src, tmp_path / "q4"), (2, 3))


def test_quantized_4bit_group_aligned_local_split(tokenizer_dir: Path, tmp_path: Path) -> None:
    # no act-order and shards on group boundaries: row-parallel layers use their local input
    src = make_random_llama(
        tmp_path / "dense", tokenizer_dir, hidden_size=128, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
    )
    _check_parity(quantize_dir(src, tmp_path / "q4", act_order=False), (2,))


@pytest.mark.parametrize("size", [0, -1, 10])
def test_bad_size_fails_before_loading(tokenizer_dir: Path, tmp_path: Path, size: int) -> None:
    """The weights file is garbage: an error about the size, not the file, shows nothing was read."""
    d = make_random_llama(
        tmp_path / "m", tokenizer_dir, hidden_size=36, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=9, num_key_value_heads=3,
    )
    (d / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(InvalidParameterError, match="tensor_parallel_size"):
        _engine(d, size)
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("halfbyte-tp-rank")]


def test_worker_load_error_reaches_rank0_and_workers_exit(tokenizer_dir: Path, tmp_path: Path) -> None:
    from halfbyte.errors import CorruptFileError

    d = make_random_llama(
        tmp_path / "m", tokenizer_dir, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2,
    )
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.0.mlp.down_proj.weight"]
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(CorruptFileError):
        _engine(d, 2)


_TORCHRUN_SCRIPT = """
import json, sys
from halfbyte.api import LLM
from halfbyte.sampling_params import SamplingParams
model, tp, out = sys.argv[1], (None if sys.argv[2] == "none" else int(sys.argv[2])), sys.argv[3]
with LLM(model, device="cpu", dtype="float32", tensor_parallel_size=tp) as llm:
    res = llm.generate(["one two three four", "a b"], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    with open(out, "w") as f:
        json.dump([r.token_ids for r in res], f)
"""


def test_torchrun_launched_ranks_match_single_process(tokenizer_dir: Path, tmp_path: Path) -> None:
    """Every torchrun rank runs the same script; rank 0 generates, rank 1 serves it and exits."""
    import subprocess
    import sys

    d = make_random_llama(
        tmp_path / "m", tokenizer_dir, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2,
    )
    script = tmp_path / "run.py"
    script.write_text(_TORCHRUN_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    subprocess.run([sys.executable, str(script), str(d), "none", str(tmp_path / "ref.json")],
                   check=True, env=env, timeout=120)
    ranks = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                            str(script), str(d), "2", str(tmp_path / "tp.json")], env=env, timeout=180,
                           capture_output=True, text=True)
    assert ranks.returncode == 0, f"torchrun failed:\n{ranks.stdout[-3000:]}\n{ranks.stderr[-3000:]}"
    ref = json.loads((tmp_path / "ref.json").read_text())
    assert json.loads((tmp_path / "tp.json").read_text()) == ref
    assert all(len(ids) == 5 for ids in ref)


def test_prefix_cache_page_copies_are_mirrored_on_every_rank(tokenizer_dir: Path, tmp_path: Path) -> None:
    """A second request over a cached 40-token prefix shares two pages and copies the partly
    matching third: the workers must make the same copy, or their KV heads read stale pages."""
    d = make_random_llama(
        tmp_path / "m", tokenizer_dir, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
    )
    prefix = list(range(300, 340))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    copies: list[int] = []

    def run(tp: int | None) -> tuple[list[list[int]], int]:
        engine = _engine(d, tp)
        if engine.tp is not None:  # count the copies sent to the workers
            send = engine.tp.copy_pages
            engine.tp.copy_pages = lambda src, dst: (copies.append(len(src)), send(src, dst))[1]  # type: ignore[method-assign]
        try:
            outs = []
            for i, tail in enumerate(([7, 8, 9], [11, 12])):  # one after the other: the second hits the cache
                engine.add_request(str(i), prefix + tail, params)
                ids: list[int] = []
                while engine.has_unfinished():
                    for o in engine.step():
                        ids += o.new_token_ids
                outs.append(ids)
            return outs, engine.stats().prefix_hit_tokens
        finally:
            engine.close()

    ref, ref_hits = run(None)
    got, hits = run(2)
    assert hits > 0 and hits == ref_hits
    assert sum(copies) > 0  # the partly matching page was copied, on the workers too
    assert got == ref
