"""The engine loop the APIs use: add_request, abort_request, step() -> outputs.

With async scheduling (on by default on CUDA) a step that only samples runs ahead: step() launches
the next step before it reads the previous one's tokens (engine/launched_step.py), so the GPU
does not wait for the host's stop checks, detokenizing and scheduling. The tokens are the same
as without it; a request's last token may cost one discarded row in the step after it."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

import torch

from halfbyte.engine.config import EngineConfig, resolve_device, resolve_dtype
from halfbyte.engine.detokenizer import IncrementalDetokenizer
from halfbyte.engine.kv_cache import PagePool
from halfbyte.engine.launched_step import LaunchedStep
from halfbyte.engine.prefix_cache import PrefixCacheStats
from halfbyte.engine.runner import ModelRunner
from halfbyte.engine.scheduler import Scheduler
from halfbyte.engine.sequence import Sequence, SequenceStatus
from halfbyte.errors import InvalidParameterError, PromptTooLongError
from halfbyte.io.model_dir import read_optional_json
from halfbyte.model.config import ModelConfig
from halfbyte.model.loader import is_quantized, load_pretrained, resolve_loadable
from halfbyte.model.rope import RopeScaling
from halfbyte.sampling_params import SamplingParams


@dataclass
class StepOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    delta_text: str
    finished: bool
    finish_reason: str | None
    logprobs: list[dict[int, float]] | None = None  # per new token: top-N and sampled token ids -> logprob


@dataclass
class EngineStats:
    num_waiting: int
    num_running: int
    num_preemptions: int
    pages_total: int
    pages_used: int  # referenced by a running sequence (cached-but-unreferenced pages count free)
    pages_free: int
    pages_cached: int  # holding a prefix-cache entry, referenced or not
    prefix_hit_tokens: int
    prefix_miss_tokens: int
    prefix_hit_pages: int
    prefix_miss_pages: int
    prefix_partial_pages: int
    prefix_evictions: int


class LLMEngine:
    def __init__(
        self,
        model: str | Path | None = None,
        *,
        dtype: str | torch.dtype = "auto",
        device: str | torch.device = "auto",
        rope_scaling: RopeScaling | str | None = None,
        config: EngineConfig | None = None,
        show_progress: bool = False,
        tensor_parallel_size: int | None = None,
    ) -> None:
        self.config = config or EngineConfig()
        self.device = resolve_device(device)
        model_dir = resolve_loadable(model, show_progress)  # imports GPTQ / AWQ / GGUF once
        self.dtype = resolve_dtype(dtype, self.device, is_quantized(model_dir))
        if self.device.type == "cuda":  # GPU.md: cuDNN SDPA costs ~2 ms of CPU per call
            torch.backends.cuda.enable_cudnn_sdp(False)
        self.tp = None  # tensor parallelism (halfbyte/distributed/): None runs the plain path
        if tensor_parallel_size is None:
            loaded = load_pretrained(model_dir, self.dtype, self.device, rope_scaling, show_progress)
        else:
            from halfbyte.distributed.engine_setup import load_tensor_parallel

            loaded, self.tp = load_tensor_parallel(model_dir, tensor_parallel_size, self.dtype, self.device, rope_scaling)
        self.model_dir = loaded.model_dir
        self.model_config = model_cfg = loaded.config
        self.tokenizer = loaded.tokenizer
        self.model = loaded.model
        self.eos_token_ids = self._eos_ids(model_cfg)
        self.max_model_len = self.config.max_model_len or model_cfg.max_position_embeddings
        page = self.config.page_size
        kv_cfg = self.tp.local_config if self.tp is not None else model_cfg  # a rank's pages hold its KV heads
        # under tensor parallelism, distributed/engine_setup.attach mirrors the pool's page copies
        self.pool = PagePool(
            kv_cfg, self._num_pages(kv_cfg), page, self.dtype, self.device, self.config.enable_prefix_caching
        )
        self.scheduler = Scheduler(self.pool, self.config.max_num_seqs, self.config.max_batch_tokens)
        self.runner = ModelRunner(self.model, self.pool, self.config.max_num_seqs, self.max_model_len)
        self.runner.sampler.eos_token_ids = set(self.eos_token_ids)
        if self.tp is not None:
            from halfbyte.distributed.engine_setup import attach

            attach(self.tp, self.pool, self.runner)
        if self.runner.graphs is not None:
            self.runner.graphs.capture_all()
        self._seqs: dict[str, Sequence] = {}
        self._arrivals = itertools.count()
        async_default = self.device.type == "cuda" and self.tp is None  # ranks step in lockstep: not yet
        self.async_scheduling = async_default if self.config.async_scheduling is None else self.config.async_scheduling
        self._in_flight: LaunchedStep | None = None  # launched, tokens not read yet

    def _num_pages(self, kv_cfg: ModelConfig) -> int:
        page = self.config.page_size
        if self.config.kv_cache_tokens is not None or self.device.type != "cuda":
            return max(16, -(-(self.config.kv_cache_tokens or self.max_model_len) // page))
        free, total = torch.cuda.mem_get_info(self.device)
        # room for one step's activations and logits: a rough upper bound, not a profile
        cfg = self.model_config
        width = 2 * cfg.hidden_size + cfg.q_size + 2 * cfg.kv_size + 2 * cfg.intermediate_size
        headroom = self.config.max_batch_tokens * width * 4 + self.config.max_num_seqs * cfg.vocab_size * 8 + (512 << 20)
        budget = free - (1 - self.config.gpu_memory_utilization) * total - headroom
        elem = torch.finfo(self.dtype).bits // 8
        page_bytes = 2 * kv_cfg.num_layers * page * kv_cfg.num_kv_heads * kv_cfg.head_dim * elem
        return max(16, int(budget // page_bytes))

    def stats(self) -> EngineStats:
        """Counters for metrics: queue lengths, pages, prefix-cache hits and misses."""
        pool, sched = self.pool, self.scheduler
        prefix = pool.prefix.stats if pool.prefix is not None else PrefixCacheStats()
        return EngineStats(
            num_waiting=len(sched.waiting),
            num_running=len(sched.running),
            num_preemptions=sched.num_preemptions,
            pages_total=pool.num_pages,
            pages_used=pool.num_used,
            pages_free=pool.num_free,
            pages_cached=len(pool.prefix.key_of) if pool.prefix is not None else 0,
            prefix_hit_tokens=prefix.hit_tokens,
            prefix_miss_tokens=prefix.miss_tokens,
            prefix_hit_pages=prefix.hit_pages,
            prefix_miss_pages=prefix.miss_pages,
            prefix_partial_pages=prefix.partial_pages,
            prefix_evictions=prefix.evictions,
        )

    def _eos_ids(self, cfg: ModelConfig) -> set[int]:
        ids = set(cfg.eos_token_ids)
        gen = read_optional_json(self.model_dir / "generation_config.json").get("eos_token_id")
        ids.update(gen if isinstance(gen, list) else [gen] if isinstance(gen, int) else [])
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> None:
        """Queue a request. Higher priority is scheduled first and preempted last; cache_salt
        (e.g. an adapter id) keeps its prefix-cache entries apart from other salts'."""
        if request_id in self._seqs:
            raise InvalidParameterError(f"request_id {request_id!r} is already running")
        if not prompt_token_ids:
            raise InvalidParameterError("the prompt is empty")
        vocab = self.model_config.vocab_size
        params.check_token_ids(vocab)
        if params.n != 1:  # LLM.generate fans n out into child requests (params.for_sample(i))
            raise InvalidParameterError(f"n must be 1 for one engine request, got {params.n}; submit params.for_sample(i) for each")
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise InvalidParameterError(f"prompt token ids must be in [0, {vocab})")
        n = len(prompt_token_ids)
        if n >= self.max_model_len:
            raise PromptTooLongError(
                f"the prompt has {n} tokens; the context window holds {self.max_model_len} (prompt + at least 1 new)"
            )
        worst_case = min(n + params.max_tokens, self.max_model_len)
        if self.pool.pages_for(worst_case) > self.pool.num_pages:
            raise PromptTooLongError(
                f"the request needs up to {worst_case} tokens of KV cache (prompt {n} + max_tokens "
                f"{params.max_tokens}); the cache holds {self.pool.num_pages * self.pool.page_size}"
            )
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(params.seed)
        seq = Sequence(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            detokenizer=IncrementalDetokenizer(
                self.tokenizer, prompt_token_ids, params.stop, params.skip_special_tokens
            ),
            generator=generator,
            arrival=next(self._arrivals),
            priority=priority,
            cache_salt=cache_salt,
        )
        self._seqs[request_id] = seq
        self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> None:
        seq = self._seqs.pop(request_id, None)
        if seq is not None:
            self.scheduler.finish(seq)
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = "abort"

    @property
    def step_in_flight(self) -> bool:
        """A launched step whose tokens the next step() reads (async scheduling)."""
        return self._in_flight is not None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or self._in_flight is not None

    def step(self) -> list[StepOutput]:
        """Schedule and launch a step; return what the steps read back during this call produced.
        A step kept in flight (async scheduling) is read during the next call, after that call
        has launched its own step; an empty list then means "nothing read yet", not "idle"."""
        outputs: list[StepOutput] = []
        previous, self._in_flight = self._in_flight, None
        if previous is not None and not self._can_run_ahead(previous):
            outputs += self._complete(previous)
            previous = None
        batch = self.scheduler.schedule()
        launched = self.runner.launch(batch, previous.tokens if previous else None) if batch is not None else None
        if previous is not None:
            outputs += self._complete(previous)
        if launched is not None:
            if self._may_defer(launched):
                self._in_flight = launched
            else:
                outputs += self._complete(launched)
        return outputs

    def _may_defer(self, launched: LaunchedStep) -> bool:
        """Whether the next step may be launched before this one's tokens are read: every row
        samples, and none needs its tokens on the host to sample (logits processors). Penalties
        count a token in flight on the device (token_state.py); logprobs travel with the tokens."""
        if not self.async_scheduling or not launched.sampling or not all(launched.batch.samples):
            return False
        return not any(s.params.logits_processors for s in launched.sampling)

    def _can_run_ahead(self, previous: LaunchedStep) -> bool:
        """Whether the next step is exactly previous's sequences decoding the tokens in flight:
        nobody waits to be admitted, nobody stops by length, and the pool has a page for each (a
        decode writes one slot: a new page or a copy-on-write, never both), so no preemption."""
        seqs = previous.sampling
        sched = self.scheduler
        if sched.waiting or len(sched.running) != len(seqs) or self.pool.num_free < len(seqs):
            return False
        return all(
            s.status is SequenceStatus.RUNNING and len(s.output_token_ids) < s.params.max_tokens
            and s.num_tokens < self.max_model_len for s in seqs
        )

    def _complete(self, launched: LaunchedStep) -> list[StepOutput]:
        """Read a launched step's tokens, put them in place of its placeholders, check stops."""
        tokens = launched.token_list()
        logprobs = launched.logprobs.entries(tokens) if launched.logprobs is not None else [None] * len(tokens)
        sampled = iter(zip(launched.slots, tokens, logprobs, strict=True))
        outputs = []
        for seq, samples in zip(launched.batch.seqs, launched.batch.samples, strict=True):
            slot, token, token_logprobs = next(sampled) if samples else (0, 0, None)
            if seq.is_finished:  # stopped (its extra row is dropped) or aborted since the launch
                continue
            if samples:
                seq.token_ids[slot] = token
            self.pool.cache_full_pages(seq)
            if not samples:  # mid-prefill: no token yet
                continue
            reason = self._check_stop(seq, token, slot + 1)
            if reason is not None:
                del seq.token_ids[slot + 1 :]  # a placeholder of the step launched after this one
                seq.status = SequenceStatus.FINISHED
                seq.finish_reason = reason
                self.scheduler.finish(seq)
                del self._seqs[seq.request_id]
            outputs.append(
                StepOutput(
                    seq.request_id,
                    [token],
                    seq.detokenizer.take_delta(seq.is_finished),
                    seq.is_finished,
                    seq.finish_reason,
                    [token_logprobs] if token_logprobs is not None else None,
                )
            )
        return outputs

    def _check_stop(self, seq: Sequence, token: int, num_tokens: int) -> str | None:
        """num_tokens: the sequence's length through this token (a later placeholder may follow)."""
        p = seq.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            return "stop"
        if seq.detokenizer.add_token(token) is not None:
            return "stop"
        if num_tokens - len(seq.prompt_token_ids) >= p.max_tokens or num_tokens >= self.max_model_len:
            return "length"
        return None

    def sequence(self, request_id: str) -> Sequence | None:
        return self._seqs.get(request_id)

    def close(self) -> None:
        for rid in list(self._seqs):
            self.abort_request(rid)
        self._in_flight = None
        self.pool.kv_caches.clear()
        del self.model
        if self.tp is not None:
            self.tp.shutdown()
            self.tp = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
