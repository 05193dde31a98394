"""Hugging Face checkpoint -> halfbyte quantized directory: layer-by-layer GPTQ with a measured
mixed-bit allocation to a bits-per-weight budget.

Two passes over the decoder layers, each holding one layer's weights and the calibration
activations (the residual stream entering the layer, [tokens, hidden]):

1. measure (block_error.measure_layer): every candidate setting (measure.default_candidates)
   of every matrix (fused qkv, o_proj, fused gate_up, down_proj) is quantized against its
   Hessian, and the error it causes in its block's output, relative to the residual stream, is
   recorded; the stream goes on through the float layer.
2. after measure.allocate picks one candidate per matrix within the budget, quantize: GPTQ
   with the chosen settings, "true sequential" (o_proj's Hessian comes from the quantized qkv
   output, and so on), and the stream goes on through the quantized layer.
3. below 4 bpw (ConvertOptions.tune_steps), tune end to end (tune.py): with every q fixed, the
   norms and the group scales and mins (coded slices: their per-column steps) are tuned by Adam
   on KL(float || quantized) of the output logits over the calibration windows. This stage holds
   the whole quantized decoder (q as uint8) and, for the backward pass, fp32 copies of its
   dequantized weights and one window's activations: the only stage that does not stream layer
   by layer, so by default it runs only for decoders up to TUNE_MAX_PARAMS weights.

With measure_cache, the calibration windows and measurements are kept there (keyed by every
setting except the budget) for conversions of the same model to other budgets.

Every finished layer is saved atomically under OUT.partial/, with the stream after it, so a
killed conversion resumes from its last finished layer and writes byte-identical files; OUT
itself appears only when complete (written as a temporary directory, then renamed)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from safetensors import safe_open
from safetensors.torch import save_file

from halfbyte.errors import HalfbyteError
from halfbyte.io.model_dir import read_json, resolve_model_dir
from halfbyte.kernels.rms_norm import rms_norm
from halfbyte.model.config import ModelConfig
from halfbyte.model.rope import RotaryEmbedding
from halfbyte.quant import calibration
from halfbyte.quant.block_error import measure_layer
from halfbyte.quant.convert_state import (
    _atomic_json, _atomic_tensors, _fingerprint, _load_stream, _save_stream, STATE_VERSION,
)
from halfbyte.quant.layer_forward import (  # noqa: F401  (re-exported for bench/ and tests)
    UNITS, LayerWeights, TensorSource, WeightSource, _hessian, _unit_shapes, read_layer, run_layer, run_layer_pair,
)
from halfbyte.quant.gptq import asymmetric_target
from halfbyte.quant.measure import LOW_BITS_BELOW, Candidate, allocate, default_candidates, quantize_candidate, storage_bits
from halfbyte.quant.packing import SUPPORTED_BITS
from halfbyte.quant.qtensor import ALLOWED_GROUP_SIZES, FORMAT_VERSION, QuantWeight, slice_storage_bits
from halfbyte.quant.rotation import RotatedSource
from halfbyte.quant.tune import TunableModel, tune

# files besides the weights and config that a model directory carries over (plus tokenizer*)
_COPIED = ("generation_config.json", "special_tokens_map.json", "chat_template.jinja", "vocab.json", "merges.txt")


CALIB_WINDOWS = 32  # calibration windows (of seq_len tokens) by default
SAMPLE_PROMPTS = 32  # self-sampled answers without calibration files: ~5k tokens, 12 windows
# When the conversion tunes, the tuning overfits ~6k tokens (calibration KL -50% at 4.25 bpw for
# -1% on held-out text), so it samples more and tunes longer (a little under three passes):
# SmolLM2 3.25 bpw, 32 -> 96 prompts (12 -> 32 windows), 36 -> 90 steps: held-out KL 0.607 -> 0.510
# (BENCHMARKS.md).
TUNE_SAMPLE_PROMPTS = 96
TUNE_STEPS = 90
TUNE_BELOW = 4.0
# The tuning stage holds the whole decoder for a backward pass (SmolLM2-135M: peak RSS 1.6 ->
# 4.2 GiB, ~20 bytes per parameter), so by default it runs only for models small enough that this
# stays a few GiB; larger ones keep the one-layer-at-a-time memory bound (--tune-steps N forces it).
TUNE_MAX_PARAMS = 300_000_000


class ConversionError(HalfbyteError):
    """The conversion cannot run with these inputs (bad budget, existing output, stale state)."""


@dataclass
class ConvertOptions:
    bits: float  # bits-per-weight budget over the decoder layers' matrices
    group_size: int | None = None  # None: the allocator chooses among 32, 64, 128 per matrix
    head_bits: int | None = None  # None: the LM head stays dense
    act_order: bool = True
    calib_files: tuple[str, ...] = ()
    seq_len: int = 512  # calibration window length, tokens
    num_windows: int = CALIB_WINDOWS
    # without calibration files the model writes its own text: sample_prompts answers (the generic
    # prompts, repeated with other seeds) of up to sample_tokens tokens; wide and short batches
    # make the most tokens per second on a CPU. None: SAMPLE_PROMPTS, or TUNE_SAMPLE_PROMPTS when tuning
    sample_prompts: int | None = None
    sample_tokens: int = 160
    damp: float = 0.01
    # GPTQ's group grids: search clipped ranges for the least input-energy-weighted rounding error
    clip_search: bool = True
    measure_tokens: int = 1024  # calibration tokens (whole windows) each candidate's block error is measured on
    show_progress: bool = True
    # None: measure.default_candidates(group_size), with its low-bit extras below LOW_BITS_BELOW bpw
    candidates: tuple[Candidate, ...] | None = None
    measure_cache: str | Path | None = None  # reuse calibration + measurement across budgets
    # end-to-end tuning of norms, scales and mins after quantization (tune.py): Adam steps over
    # the calibration windows. None: TUNE_STEPS where tunes_by_default (below
    # TUNE_BELOW bpw, where it was measured to pay: SmolLM2 3.25 bpw held-out KL -8%, 4.25 only -1%
    # for ~4 minutes; and only for decoders of at most TUNE_MAX_PARAMS weights), else 0
    tune_steps: int | None = None
    # GPTQ against the float model's layer outputs (gptq.asymmetric_target) instead of the
    # quantized model's own: each layer also corrects what the layers before it lost.
    # None: below TUNE_BELOW bpw (at 4.25 the source's exact 4-bit grids must stay reachable)
    asymmetric: bool | None = None
    # damping of the correction's solve, relative to mean(diag H): SmolLM2 3.25 bpw untuned,
    # held-out KL 0.572 without the correction, 0.680 / 0.562 / 0.518 / 0.532 at 0.01 / 0.1 / 1 / 3
    # (the correction is fitted on the calibration tokens and overfits them when barely damped)
    asym_damp: float = 1.0
    # see the float model through random orthogonal rotations (rotation.py) before quantizing:
    # spreads outlier columns over all of them. Off by default: on SmolLM2 (weights from a Q4_1
    # GGUF, so on 4-bit group-32 grids that rotation destroys) the 3.25 bpw default got worse,
    # held-out ppl 45.08 -> 48.46, though plain 3-bit g64 GPTQ gained (KL -15%). rotation_seed
    # picks the rotations.
    rotate: bool = False
    rotation_seed: int = 0
    tune_lr_norm: float = 1e-3
    tune_lr_scale: float = 2e-4
    # test hook: called after each finished layer as (pass name, layer index)
    after_layer: Callable[[str, int], None] | None = field(default=None, repr=False, compare=False)

    def validate(self) -> None:
        b = self.bits
        if not isinstance(b, (int, float)) or isinstance(b, bool) or not math.isfinite(b) or not 2.0 <= b <= 8.0:
            raise ConversionError(f"--bits must be a budget between 2 and 8 bits per weight, got {b!r}")
        if self.group_size is not None and self.group_size not in ALLOWED_GROUP_SIZES:
            raise ConversionError(f"--group-size must be one of {ALLOWED_GROUP_SIZES}, got {self.group_size}")
        if self.head_bits is not None and self.head_bits not in SUPPORTED_BITS:
            raise ConversionError(f"--head-bits must be one of {SUPPORTED_BITS}, got {self.head_bits}")
        if self.seq_len < 16 or self.num_windows < 1:
            raise ConversionError("calibration needs windows of at least 16 tokens and at least 1 window")
        if self.tune_steps is not None and (isinstance(self.tune_steps, bool) or not isinstance(self.tune_steps, int) or self.tune_steps < 0):
            raise ConversionError(f"--tune-steps must be an integer >= 0, got {self.tune_steps!r}")
        if self.sample_prompts is not None and self.sample_prompts < 1:
            raise ConversionError(f"sample_prompts must be at least 1, got {self.sample_prompts}")

    def candidate_list(self) -> list[Candidate]:
        """The candidates to measure: the given ones, or the defaults for the budget's range."""
        if self.candidates:
            return list(self.candidates)
        return default_candidates(self.group_size, low_bits=self.bits < LOW_BITS_BELOW)

    def steps(self) -> int:
        """End-to-end tuning steps (convert() resolves the default for the model first)."""
        return self.tune_steps or 0


def tunes_by_default(bits: float, cfg: ModelConfig) -> bool:
    """Below TUNE_BELOW bpw, for decoders of at most TUNE_MAX_PARAMS weights."""
    params = cfg.num_layers * sum(n * k for n, k in _unit_shapes(cfg).values())
    return bits < TUNE_BELOW and params <= TUNE_MAX_PARAMS


def resolve_defaults(opts: ConvertOptions, cfg: ModelConfig) -> ConvertOptions:
    """The options with every None default decided for this model and budget (before the
    fingerprint, so a resumed or cached conversion sees the same numbers)."""
    tuning = tunes_by_default(opts.bits, cfg) if opts.tune_steps is None else opts.tune_steps > 0
    prompts = opts.sample_prompts or (TUNE_SAMPLE_PROMPTS if tuning else SAMPLE_PROMPTS)
    steps = opts.tune_steps if opts.tune_steps is not None else (TUNE_STEPS if tuning else 0)
    asymmetric = opts.asymmetric if opts.asymmetric is not None else opts.bits < TUNE_BELOW
    return dataclasses.replace(opts, sample_prompts=prompts, tune_steps=steps, asymmetric=asymmetric)


@dataclass
class ConvertResult:
    out_dir: Path
    bits_per_weight: float  # decoder matrices, every stored bit
    total_bits_per_weight: float  # every quantized matrix including a quantized head
    seconds: float
    choices: dict[str, str]  # matrix prefix -> candidate name
    errors: dict[str, float]  # matrix prefix -> relative error of the final quantization


# --- the conversion -----------------------------------------------------------------------------


def _check_budget(cfg: ModelConfig, cands: list[Candidate], opts: ConvertOptions) -> None:
    shapes = _unit_shapes(cfg)
    for n, k in shapes.values():
        if k % 32:
            raise ConversionError(f"in_features {k} is not a multiple of 32; the format cannot store it")
    weights = sum(n * k for n, k in shapes.values())
    least = sum(min(storage_bits(c, n, k, opts.act_order) for c in cands) for n, k in shapes.values())
    if opts.bits * weights < least:
        raise ConversionError(
            f"--bits {opts.bits} is below the {least / weights:.3f} bits per weight that the smallest "
            "setting (2 bits with its group scales" + (", act-order permutation" if opts.act_order else "") + ") needs"
        )


def _calibration(model_dir: Path, tokenizer: Any, opts: ConvertOptions, docs: list[str] | None) -> list[list[int]]:
    if docs is not None:
        streams = calibration.tokenize_texts(docs, tokenizer)
    else:
        assert opts.sample_prompts is not None  # resolve_defaults decided it
        streams = calibration.sample_model_tokens(model_dir, num_prompts=opts.sample_prompts, max_tokens=opts.sample_tokens)
    return calibration.calibration_windows(streams, opts.seq_len, opts.num_windows, tokenizer.eos_token_id)


def _progress(show: bool) -> Progress:
    return Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        TextColumn("{task.fields[info]}"), console=Console(stderr=True), disable=not show,
    )


def convert(model: str | Path, out: str | Path, opts: ConvertOptions) -> ConvertResult:
    """Convert the float checkpoint `model` into a quantized directory `out` (see module doc)."""
    from halfbyte.io.tokenizer import Tokenizer

    t_start = time.perf_counter()
    opts.validate()
    out_dir = Path(out)
    if out_dir.exists():
        raise ConversionError(f"{out_dir} already exists; choose a new output directory")
    model_dir = resolve_model_dir(model)
    hf_cfg = read_json(model_dir / "config.json")
    if "quantization" in hf_cfg:
        raise ConversionError(f"{model_dir} is already quantized; convert its float checkpoint")
    cfg = ModelConfig.from_hf(hf_cfg)
    opts = resolve_defaults(opts, cfg)
    cands = opts.candidate_list()
    _check_budget(cfg, cands, opts)
    docs = calibration.read_calibration_texts(opts.calib_files) if opts.calib_files else None
    src: WeightSource = TensorSource(model_dir)
    if opts.rotate:  # the rotated model has an untied head (rotation.py)
        src = RotatedSource(src, cfg, opts.rotation_seed)
        cfg = dataclasses.replace(cfg, tie_word_embeddings=False)
        hf_cfg = {**hf_cfg, "tie_word_embeddings": False}
    tokenizer = Tokenizer(model_dir)

    partial = out_dir.with_name(out_dir.name + ".partial")
    fingerprint = json.loads(json.dumps(_fingerprint(model_dir, opts)))  # as it reads back
    if partial.exists():
        state_file = partial / "state.json"
        if not state_file.is_file() or json.loads(state_file.read_text()) != fingerprint:
            raise ConversionError(
                f"{partial} holds an unfinished conversion with other settings or another model; "
                "delete it, or rerun with the same arguments to resume"
            )
    else:
        partial.mkdir(parents=True)
        _atomic_json(partial / "state.json", fingerprint)
    (partial / "quant").mkdir(exist_ok=True)
    # calibration and measurement do not depend on the budget: with measure_cache they live in
    # a directory keyed by everything else, and other budgets reuse them
    mdir = partial
    if opts.measure_cache is not None:
        keyed = {k: v for k, v in fingerprint.items() if k not in ("bits", "head_bits", "tune", "asymmetric")}
        digest = hashlib.sha256(json.dumps(keyed, sort_keys=True).encode()).hexdigest()[:16]
        mdir = Path(opts.measure_cache) / digest
        mdir.mkdir(parents=True, exist_ok=True)
        _atomic_json(mdir / "settings.json", keyed)
    (mdir / "measure").mkdir(exist_ok=True)

    calib_file = mdir / "calibration.json"
    if not calib_file.is_file():
        _atomic_json(calib_file, _calibration(model_dir, tokenizer, opts, docs))
    windows: list[list[int]] = json.loads(calib_file.read_text())
    lengths = [len(w) for w in windows]
    rotary = RotaryEmbedding(
        cfg.rope_scaling, cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings, torch.device("cpu"), torch.float32
    )

    def embed() -> torch.Tensor:
        table = src.get("model.embed_tokens.weight")
        return table[torch.tensor([t for w in windows for t in w])].float()  # [T, hidden]

    shapes = _unit_shapes(cfg)
    with _progress(opts.show_progress) as progress:
        console = progress.console
        # the model's own text is far easier for it than real text (SmolLM2: 1.5 against 3.0-3.3
        # nats per token), and below 4 bpw that costs: 3.25 bpw held-out ppl +58.9% against +31.5%
        # calibrated on Wikipedia text (BENCHMARKS.md)
        source = "" if docs is not None else " sampled from the model (real text via --calib FILE calibrates better)"
        console.print(
            f"calibration: {len(windows)} windows, {sum(lengths)} tokens{source}; {len(cands)} candidates per matrix "
            f"[{time.perf_counter() - t_start:.0f} s]"
        )

        # pass 1: measurement
        task = progress.add_task("measure", total=cfg.num_layers, info="")
        resumed = _load_stream(mdir / "measure" / "stream.safetensors")
        stale = any(
            json.loads(f.read_text()).get("version") != STATE_VERSION
            for f in sorted((mdir / "measure").glob("layer_*.json"))
        )
        if stale:  # measured by an older version: measure again from the start
            resumed = None
        first, stream = resumed if resumed is not None else (0, embed())
        progress.update(task, completed=first)
        for i in range(first, cfg.num_layers):
            lw = read_layer(src, i)
            errors, stream = measure_layer(
                cfg, lw, stream, lengths, rotary, cands, act_order=opts.act_order, damp=opts.damp,
                max_tokens=opts.measure_tokens, clip_search=opts.clip_search,
            )
            _atomic_json(mdir / "measure" / f"layer_{i:05d}.json", {"version": STATE_VERSION, **errors})
            _save_stream(mdir / "measure" / "stream.safetensors", i + 1, stream)
            ref = next((j for j, c in enumerate(cands) if c.parts == ((1.0, 4),)), 0)
            info = "  ".join(f"{u.split('.')[1].removesuffix('_proj')} {errors[u][ref]:.2e}" for u in UNITS)
            progress.update(task, advance=1, info=f"{cands[ref].name} error {info}")
            if opts.after_layer is not None:
                opts.after_layer("measure", i)
        del stream

        # allocation: minimise the summed stream errors within the budget
        prefixes, costs, errs = [], [], []
        for i in range(cfg.num_layers):
            measured = json.loads((mdir / "measure" / f"layer_{i:05d}.json").read_text())
            for unit in UNITS:
                n, k = shapes[unit]
                prefixes.append(f"model.layers.{i}.{unit}")
                costs.append([storage_bits(c, n, k, opts.act_order) for c in cands])
                errs.append(measured[unit])
        total_weights = cfg.num_layers * sum(n * k for n, k in shapes.values())
        picks = allocate(costs, errs, opts.bits * total_weights)
        chosen = {p: cands[j] for p, j in zip(prefixes, picks, strict=True)}
        used = sum(c[j] for c, j in zip(costs, picks, strict=True))
        predicted = sum(e[j] for e, j in zip(errs, picks, strict=True))
        console.print(
            f"allocation: {used / total_weights:.4f} bits per weight (budget {opts.bits}), predicted stream "
            f"error {predicted:.4g} [{time.perf_counter() - t_start:.0f} s]"
        )

        # pass 2: quantization
        task = progress.add_task("quantize", total=cfg.num_layers, info="")
        stream_file = partial / "quant" / "stream.safetensors"
        resumed = _load_stream(stream_file)
        first, stream = resumed if resumed is not None else (0, embed())
        float_stream = None
        if opts.asymmetric:  # the float model's stream beside the quantized one (asymmetric_target)
            saved = _load_stream(stream_file, "float_stream")
            if resumed is not None and saved is None:
                raise ConversionError(f"{stream_file} lacks the float model's stream; delete {partial} and rerun")
            float_stream = saved[1] if saved is not None else stream.clone()
        progress.update(task, completed=first)
        for i in range(first, cfg.num_layers):
            lw = read_layer(src, i)
            qweights: dict[str, QuantWeight] = {}
            rel: dict[str, float] = {}

            def quantize(unit: str, h: torch.Tensor, w: torch.Tensor, d: torch.Tensor | None = None) -> torch.Tensor:
                target = w if d is None else asymmetric_target(w, h, d, opts.asym_damp)
                qw, loss = quantize_candidate(
                    target, h, chosen[f"model.layers.{i}.{unit}"], act_order=opts.act_order, damp=opts.damp,
                    clip_search=opts.clip_search,
                )
                signal = 0.5 * float(((target @ h) * target).sum())
                qweights[unit], rel[unit] = qw, (loss / signal if signal > 0 else 0.0)
                return qw.dequantize()

            if float_stream is None:
                stream = run_layer(cfg, lw, stream, lengths, rotary, quantize)
            else:
                stream, float_stream = run_layer_pair(
                    cfg, lw, stream, float_stream, lengths, rotary, lambda u, h, d, w: quantize(u, h, w, d)
                )
            tensors: dict[str, torch.Tensor] = {
                f"model.layers.{i}.input_layernorm.weight": lw.input_norm,
                f"model.layers.{i}.post_attention_layernorm.weight": lw.post_norm,
            }
            for unit in UNITS:
                prefix = f"model.layers.{i}.{unit}"
                tensors.update(qweights[unit].to_state_dict(prefix))
                if lw.biases[unit] is not None:
                    tensors[f"{prefix}.bias"] = lw.biases[unit]  # type: ignore[assignment]
            _atomic_tensors(partial / "quant" / f"layer_{i:05d}.safetensors", tensors)
            _atomic_json(partial / "quant" / f"layer_{i:05d}.json", {u: {"meta": qweights[u].meta(), "rel_error": rel[u]} for u in UNITS})
            _save_stream(stream_file, i + 1, stream, float_stream)
            info = "  ".join(f"{u.split('.')[1].removesuffix('_proj')} {chosen[f'model.layers.{i}.{u}'].name} {rel[u]:.1e}" for u in UNITS)
            progress.update(task, advance=1, info=info)
            if opts.after_layer is not None:
                opts.after_layer("quantize", i)

        # the head (quantized against the final hidden states) and the dense remainder
        rest: dict[str, torch.Tensor] = {"model.embed_tokens.weight": src.get("model.embed_tokens.weight"),
                                         "model.norm.weight": src.get("model.norm.weight")}
        head_meta: dict[str, Any] = {}
        if opts.head_bits is not None:
            head_file = partial / "head.safetensors"
            if not head_file.is_file():
                x = rms_norm(stream, rest["model.norm.weight"].float(), cfg.rms_norm_eps)
                w_head = (src.get("lm_head.weight") if src.has("lm_head.weight") and not cfg.tie_word_embeddings
                          else rest["model.embed_tokens.weight"]).float()
                cand = Candidate(((1.0, opts.head_bits),), opts.group_size or 128)
                qw, _ = quantize_candidate(
                    w_head, _hessian(x), cand, act_order=opts.act_order, damp=opts.damp, clip_search=opts.clip_search
                )
                _atomic_tensors(head_file, qw.to_state_dict("lm_head"), {"meta": json.dumps(qw.meta())})
            with safe_open(str(head_file), framework="pt") as f:
                head_meta = json.loads(f.metadata()["meta"])
                rest.update({k: f.get_tensor(k) for k in f.keys()})
        elif not cfg.tie_word_embeddings:
            rest["lm_head.weight"] = src.get("lm_head.weight")
        del stream, float_stream
        console.print(f"quantized [{time.perf_counter() - t_start:.0f} s]")
        layer_dir = partial / "quant"
        if opts.steps() > 0:
            layer_dir = _tune_stage(cfg, src, partial, mdir, windows, rotary, rest, head_meta, opts, progress)
            rest["model.norm.weight"] = _read_tensors(layer_dir / "norm.safetensors")["model.norm.weight"]
            losses = json.loads((layer_dir / "done.json").read_text())["losses"]
            n = min(len(windows), len(losses))  # one pass over the windows at the start and at the end
            console.print(f"tuned: calibration KL {sum(losses[:n]) / n:.4f} (first pass) -> "
                          f"{sum(losses[-n:]) / n:.4f} (last) [{time.perf_counter() - t_start:.0f} s]")
        result = _assemble(model_dir, out_dir, partial, layer_dir, len(windows), hf_cfg, cfg, rest, head_meta, opts)

    result.seconds = time.perf_counter() - t_start
    result.choices = {p: c.name for p, c in chosen.items()}
    return result


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _tune_stage(
    cfg: ModelConfig, src: WeightSource, partial: Path, mdir: Path, windows: list[list[int]], rotary: RotaryEmbedding,
    rest: dict[str, torch.Tensor], head_meta: dict[str, Any], opts: ConvertOptions, progress: Progress,
) -> Path:
    """End-to-end tuning (tune.py) of the quantized layers under partial/quant against the float
    model's final hidden states (the measurement pass's last stream). Writes partial/tuned/ and
    its done.json last; a killed run tunes again from the start (deterministic, same bytes)."""
    tuned = partial / "tuned"
    if (tuned / "done.json").is_file():
        return tuned
    tuned.mkdir(exist_ok=True)
    resumed = _load_stream(mdir / "measure" / "stream.safetensors")
    if resumed is None or resumed[0] != cfg.num_layers:
        raise ConversionError(f"{mdir / 'measure'} lacks the float model's final stream; delete it and convert again")
    ref_norm = src.get("model.norm.weight").float()
    ref_all = rms_norm(resumed[1], ref_norm, cfg.rms_norm_eps)
    ref_hidden = list(ref_all.split([len(w) for w in windows]))
    embed = src.get("model.embed_tokens.weight").float()
    ref_head = (src.get("lm_head.weight").float() if src.has("lm_head.weight") and not cfg.tie_word_embeddings else embed)
    if head_meta:
        head = QuantWeight.from_state_dict("lm_head", rest, head_meta).dequantize()
    else:
        head = rest["lm_head.weight"].float() if "lm_head.weight" in rest else embed
    layer_tensors = [_read_tensors(partial / "quant" / f"layer_{i:05d}.safetensors") for i in range(cfg.num_layers)]
    metas = [{u: v["meta"] for u, v in json.loads((partial / "quant" / f"layer_{i:05d}.json").read_text()).items()}
             for i in range(cfg.num_layers)]
    model = TunableModel(layer_tensors, metas, rest["model.norm.weight"])
    steps = opts.steps()
    task = progress.add_task("tune", total=steps, info="")

    def on_step(step: int, loss: float) -> None:
        progress.update(task, advance=1, info=f"calibration KL {loss:.4f}")
        if opts.after_layer is not None:
            opts.after_layer("tune", step)

    losses = tune(cfg, model, rotary, embed, head, ref_head, windows, ref_hidden, steps, opts.tune_lr_norm,
                  opts.tune_lr_scale, on_step)
    layers, final_norm = model.state_dicts()
    for i, tensors in enumerate(layers):
        _atomic_tensors(tuned / f"layer_{i:05d}.safetensors", tensors)
    _atomic_tensors(tuned / "norm.safetensors", {"model.norm.weight": final_norm})
    _atomic_json(tuned / "done.json", {"losses": losses})
    return tuned


def _meta_storage_bits(meta: dict[str, Any]) -> int:
    """QuantWeight.storage_bits() from a layer's metadata (docs/format.md's accounting)."""
    n = meta["out_features"]
    total = 32 * meta["in_features"] if meta["act_order"] else 0
    for s in meta["slices"]:
        coded = (s["scale_bits"], s["min_bits"]) if s.get("scale_codes") == "table" else bool(s.get("scale_codes"))
        total += slice_storage_bits(s["k_end"] - s["k_start"], s["bits"], s["group_size"], n, coded)
    return total


def _assemble(
    model_dir: Path,
    out_dir: Path,
    partial: Path,
    layer_dir: Path,
    num_windows: int,
    hf_cfg: dict[str, Any],
    cfg: ModelConfig,
    rest: dict[str, torch.Tensor],
    head_meta: dict[str, Any],
    opts: ConvertOptions,
) -> ConvertResult:
    """Write the finished directory as OUT.tmp, rename it to OUT, drop OUT.partial."""
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    num_files = cfg.num_layers + 1
    weight_map: dict[str, str] = {}
    layers_meta: dict[str, Any] = {}
    errors: dict[str, float] = {}
    q_bits = q_weights = 0
    for i in range(cfg.num_layers):
        name = f"model-{i + 1:05d}-of-{num_files:05d}.safetensors"
        shutil.copyfile(layer_dir / f"layer_{i:05d}.safetensors", tmp / name)
        info = json.loads((partial / "quant" / f"layer_{i:05d}.json").read_text())
        for unit in UNITS:
            prefix = f"model.layers.{i}.{unit}"
            layers_meta[prefix] = info[unit]["meta"]
            errors[prefix] = info[unit]["rel_error"]
        with safe_open(str(tmp / name), framework="pt") as f:
            for key in f.keys():
                weight_map[key] = name
    for meta in layers_meta.values():
        q_bits += _meta_storage_bits(meta)
        q_weights += meta["out_features"] * meta["in_features"]
    decoder_bpw = q_bits / q_weights
    name = f"model-{num_files:05d}-of-{num_files:05d}.safetensors"
    save_file({k: v.contiguous() for k, v in rest.items()}, str(tmp / name))
    weight_map.update(dict.fromkeys(rest, name))
    if head_meta:
        layers_meta["lm_head"] = head_meta
        head = QuantWeight.from_state_dict("lm_head", rest, head_meta)
        q_bits += head.storage_bits()
        q_weights += head.out_features * head.in_features
    total_bpw = q_bits / q_weights
    index = {"metadata": {"total_size": sum((tmp / f).stat().st_size for f in set(weight_map.values()))},
             "weight_map": dict(sorted(weight_map.items()))}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    new_cfg = dict(hf_cfg)
    if head_meta and cfg.tie_word_embeddings:
        new_cfg["tie_word_embeddings"] = False  # the quantized head is now its own tensor
    new_cfg["quantization"] = {
        "quant_method": "halfbyte",
        "format_version": FORMAT_VERSION,
        "bits_per_weight": round(total_bpw, 4),
        "budget_bits_per_weight": opts.bits,
        **({"rotation": {"kind": "random_orthogonal", "seed": opts.rotation_seed}} if opts.rotate else {}),
        "calibration": f"{num_windows} windows of up to {opts.seq_len} tokens, "
        + ("files " + ", ".join(Path(p).name for p in opts.calib_files) if opts.calib_files else "sampled from the model"),
        "layers": layers_meta,
    }
    (tmp / "config.json").write_text(json.dumps(new_cfg, indent=2))
    for f in sorted(model_dir.iterdir()):
        if f.is_file() and (f.name in _COPIED or f.name.startswith("tokenizer")):
            shutil.copyfile(f, tmp / f.name)
    os.replace(tmp, out_dir)
    shutil.rmtree(partial)
    return ConvertResult(out_dir, decoder_bpw, total_bpw, 0.0, {}, errors)
