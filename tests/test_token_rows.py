"""Extend batches as one-token rows (engine/token_rows.py), the shape the decode graphs replay:
the expansion itself, its equality with extend attention on a tiny random model, the runner's
graph path (a CPU stand-in for the CUDA graphs: same buffers, buckets and padding, eager replay),
and whole requests through the engine with a prefix-cache hit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from halfbyte.engine.config import EngineConfig
from halfbyte.engine.cuda_graphs import CudaGraphDecoder
from halfbyte.engine.detokenizer import IncrementalDetokenizer
from halfbyte.engine.kv_cache import PagePool
from halfbyte.engine.llm_engine import LLMEngine
from halfbyte.engine.runner import ModelRunner
from halfbyte.engine.scheduler import ScheduledBatch
from halfbyte.engine.sequence import Sequence
from halfbyte.engine.token_rows import row_context, token_rows
from halfbyte.kernels.attention import AttentionMetadata
from halfbyte.model.config import ModelConfig
from halfbyte.model.llama import LlamaModel
from halfbyte.sampling_params import SamplingParams

PAGE = 4
CFG = ModelConfig(architecture="llama", vocab_size=97, hidden_size=32, intermediate_size=48, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-5, rope_theta=1e4,
                  max_position_embeddings=256)


def make_seq(tokens: list[int], computed: int = 0, block_table: list[int] | None = None) -> Sequence:
    det = IncrementalDetokenizer.__new__(IncrementalDetokenizer)  # never used here
    seq = Sequence("r", list(tokens), SamplingParams(), det)
    seq.num_computed_tokens = computed
    seq.block_table = list(block_table or [])
    return seq


def test_expansion_of_a_hand_made_batch() -> None:
    extend = make_seq([10, 11, 12, 13, 14, 15, 16, 17], computed=5, block_table=[7, 2])  # a prefix hit: 3 new
    chunk = make_seq([20, 21, 22, 23, 24, 25], computed=0, block_table=[5])  # first chunk of 2: no sample
    decode = make_seq([30, 31, 32, 33, 34, 35, 36], computed=6, block_table=[1, 9])
    batch = ScheduledBatch([extend, chunk, decode], [3, 2, 1])
    assert batch.samples == [True, False, True]

    rows = token_rows(batch, PAGE)
    assert rows.input_ids == [15, 16, 17, 20, 21, 36]
    assert rows.positions == [5, 6, 7, 0, 1, 6]
    # position p lives at block_table[p // 4] * 4 + p % 4
    assert rows.slots == [2 * 4 + 1, 2 * 4 + 2, 2 * 4 + 3, 5 * 4 + 0, 5 * 4 + 1, 9 * 4 + 2]
    assert rows.seq_lens == [6, 7, 8, 1, 2, 7]
    assert rows.row_seqs == [0, 0, 0, 1, 1, 2]
    assert rows.sample_rows == [2, 5]  # the extend's last token and the decode; the chunk samples nothing
    assert row_context(batch) == sum(rows.seq_lens)
    assert extend.num_computed_tokens == 5  # expanding marks nothing computed

    tables = torch.tensor([[7, 2], [5, 0], [1, 9]], dtype=torch.int32)
    ids, positions, meta = rows.prepare(tables)
    assert ids.tolist() == rows.input_ids and positions.tolist() == rows.positions
    assert meta.is_decode and meta.query_start == list(range(7))
    assert meta.block_tables.tolist() == [[7, 2]] * 3 + [[5, 0]] * 2 + [[1, 9]]
    assert meta.slot_mapping.tolist() == rows.slots and meta.slot_mapping.dtype == torch.int64
    assert meta.device_seq_lens().tolist() == rows.seq_lens and meta.device_seq_lens().dtype == torch.int32

    decodes = token_rows(ScheduledBatch([decode], [1]), PAGE)  # one row per sequence: the tables as they are
    assert decodes.prepare(tables[2:])[2].block_tables.tolist() == [[1, 9]]


def random_model(seed: int = 0) -> LlamaModel:
    torch.manual_seed(seed)
    model = LlamaModel(CFG, torch.float32, torch.device("cpu"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layernorm" in name or name == "norm":
                p.uniform_(0.8, 1.2)
            else:
                p.normal_(0, 0.3)
    return model


def mixed_batch(pool: PagePool, runner: ModelRunner) -> ScheduledBatch:
    """A cached prefix then a batch of: an extend over it, a fresh prompt's first chunk, a full
    short prompt, a decode; pages interleaved so no table is consecutive."""
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, CFG.vocab_size, (n,), generator=gen).tolist() for n in (23, 11, 5, 14)]
    seqs = [make_seq(p) for p in prompts]
    for upto in range(0, 24, PAGE):  # interleave the page allocations
        for s in seqs:
            if upto < s.num_tokens:
                pool.grow(s.block_table, min(s.num_tokens, upto + PAGE))
    extend, chunk, short, decode = seqs
    runner.forward_logits(ScheduledBatch([extend, decode], [18, 13]))  # the cached part: eager, as a prefill
    return ScheduledBatch([extend, chunk, short, decode], [5, 6, 5, 1])


def snapshot(pool: PagePool) -> list[torch.Tensor]:
    return [t.clone() for kv in pool.kv_caches for t in kv]


def restore(pool: PagePool, saved: list[torch.Tensor], batch: ScheduledBatch, computed: list[int]) -> None:
    for t, s in zip((t for kv in pool.kv_caches for t in kv), saved, strict=True):
        t.copy_(s)
    for seq, n in zip(batch.seqs, computed, strict=True):
        seq.num_computed_tokens = n


def setup(num_pages: int = 24) -> tuple[LlamaModel, PagePool, ModelRunner, ScheduledBatch]:
    model = random_model()
    pool = PagePool(CFG, num_pages, PAGE, torch.float32, torch.device("cpu"))
    runner = ModelRunner(model, pool, max_num_seqs=16, max_model_len=64)
    return model, pool, runner, mixed_batch(pool, runner)


@torch.inference_mode()
def test_token_rows_equal_extend_attention() -> None:
    model, pool, runner, batch = setup()
    assert batch.samples == [True, False, True, True]
    computed = [s.num_computed_tokens for s in batch.seqs]
    saved = snapshot(pool)
    want = runner.forward_logits(batch)  # the eager extend path: [3, vocab]
    want_cache = snapshot(pool)

    restore(pool, saved, batch, computed)
    rows = token_rows(batch, PAGE)
    tables = torch.tensor([s.block_table + [0] * (6 - len(s.block_table)) for s in batch.seqs], dtype=torch.int32)
    ids, positions, meta = rows.prepare(tables)
    hidden = model(ids, positions, pool.kv_caches, meta)  # 17 one-token rows, decode-shaped
    got = model.compute_logits(hidden)[rows.sample_rows]

    assert got.shape == want.shape == (3, CFG.vocab_size)
    assert want.std() > 0.1  # logits that differ: a wrong context would show
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for a, b in zip(snapshot(pool), want_cache, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


class _EagerReplay:
    def __init__(self, graphs: EagerGraphs, bs: int) -> None:
        self.graphs, self.bs = graphs, bs

    def replay(self) -> None:
        g, bs = self.graphs, self.bs
        meta = AttentionMetadata(  # as CudaGraphDecoder._forward, but the reference attention reads
            query_start=list(range(bs + 1)),  # host seq_lens where the Triton kernel reads the device ones
            seq_lens=g.seq_lens[:bs].tolist(),
            block_tables=g.block_tables[:bs],
            slot_mapping=g.slot_mapping[:bs],
        )
        g.logits[bs] = g.model.compute_logits(g.model(g.input_ids[:bs], g.positions[:bs], g.kv_caches, meta))
        g.replays.append(bs)


class EagerGraphs(CudaGraphDecoder):
    """CudaGraphDecoder's buffers, buckets and padding rows, each replay an eager forward (no
    graphs on the CPU)."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.replays: list[int] = []

    def capture(self, bs: int) -> None:
        self.graphs[bs] = _EagerReplay(self, bs)  # type: ignore[assignment]


@torch.inference_mode()
def test_runner_graph_path_equals_eager() -> None:
    model, pool, runner, batch = setup()
    computed = [s.num_computed_tokens for s in batch.seqs]
    saved = snapshot(pool)
    want = runner.forward_logits(batch)

    restore(pool, saved, batch, computed)
    runner.graphs = EagerGraphs(model, pool.kv_caches, 32, 64, pool.scratch_page)
    got = runner.forward_logits(batch)
    assert runner.graphs.replays == [24]  # 17 rows, padded to the 24 bucket
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert [s.num_computed_tokens for s in batch.seqs] == [c + n for c, n in zip(computed, batch.num_new_tokens)]


@pytest.mark.parametrize("case", ["bucket too small", "sequence past max_seq_len", "switched off"])
@torch.inference_mode()
def test_runner_keeps_extends_eager_when_they_do_not_fit(case: str) -> None:
    model, pool, runner, batch = setup()
    max_batch, max_len = (16, 64) if case == "bucket too small" else (32, 64)
    if case == "sequence past max_seq_len":
        max_len = 20  # the extend reaches 23 tokens
    runner.graphs = EagerGraphs(model, pool.kv_caches, max_batch, max_len, pool.scratch_page)
    runner.graph_extend = case != "switched off"
    runner.forward_logits(batch)
    assert runner.graphs.replays == []
    decodes = [s for s, sampled in zip(batch.seqs, batch.samples, strict=True) if sampled and s.num_tokens < max_len]
    assert decodes
    for s in decodes:  # their next token: decodes still replay
        s.token_ids.append(1)
        pool.grow(s.block_table, s.num_tokens)
    runner.forward_logits(ScheduledBatch(decodes, [1] * len(decodes)))
    assert runner.graphs.replays == [runner.graphs.bucket(len(decodes))]


def test_engine_prefix_hit_through_graph_rows(default_model_dir: Path) -> None:
    """Whole requests: a cached-prefix request, a chunked prompt and decodes through the row path
    give the tokens of an engine without the prefix cache or graphs."""
    greedy = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    prefix = list(range(1000, 1040))  # 40 tokens: 2 full pages of 16 cached
    prompts = [prefix + [7, 8, 9], prefix + [11, 12, 13, 14], list(range(2000, 2030))]

    def run(engine: LLMEngine) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in prompts]
        for group in ([0], [1, 2]):  # the first puts the prefix in the cache; then a hit and a fresh prompt
            for i in group:
                engine.add_request(f"r{i}", prompts[i], greedy)
            while engine.has_unfinished():
                for o in engine.step():
                    out[int(o.request_id[1:])].extend(o.new_token_ids)
        return out

    plain = LLMEngine(default_model_dir, device="cpu", dtype="float32",
                      config=EngineConfig(enable_prefix_caching=False, max_model_len=256))
    want = run(plain)
    cfg = EngineConfig(max_model_len=256, max_num_seqs=24, max_batch_tokens=24, kv_cache_tokens=1024)
    engine = LLMEngine(default_model_dir, device="cpu", dtype="float32", config=cfg)
    graphs = EagerGraphs(engine.model, engine.pool.kv_caches, 24, 256, engine.pool.scratch_page)
    engine.runner.graphs = graphs
    got = run(engine)
    assert got == want
    assert engine.stats().prefix_hit_tokens >= 32  # request 1 reused the cached prefix pages
    assert len(graphs.replays) > 5 and 24 in graphs.replays  # extends (24-token chunks) went through the rows


def test_graphs_only_where_the_decode_kernel_reads_device_lengths(monkeypatch: pytest.MonkeyPatch) -> None:
    from dataclasses import replace
    from types import SimpleNamespace

    from halfbyte.engine.runner import _graphable
    from halfbyte.model.rope import RopeScaling

    def graphable(page: int = 16, device: str = "cuda", **cfg: object) -> bool:
        model = SimpleNamespace(device=torch.device(device), cfg=replace(CFG, **{"head_dim": 64, **cfg}))
        return _graphable(model, page)  # type: ignore[arg-type]

    assert graphable() and not graphable(device="cpu")
    assert not graphable(page=8) and not graphable(head_dim=96) and not graphable(sliding_window=4096)
    assert not graphable(rope_scaling=RopeScaling(type="dynamic", factor=2.0))
    monkeypatch.setenv("HALFBYTE_REFERENCE", "1")
    assert not graphable()
