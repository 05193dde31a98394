"""Asymmetric calibration (gptq.asymmetric_target): GPTQ on the quantized model's inputs X
aimed at the float model's outputs X_f W^T."""

from __future__ import annotations

import torch

from halfbyte.quant.gptq import CrossAccumulator, HessianAccumulator, asymmetric_target


def _inputs(tokens: int = 3000, k: int = 48, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """X_f and a perturbed X (what the quantized layers before would feed)."""
    g = torch.Generator().manual_seed(seed)
    x_float = torch.randn(tokens, k, generator=g) @ torch.randn(k, k, generator=g) / k**0.5
    return x_float, x_float + 0.2 * torch.randn(tokens, k, generator=g)


def _stats(x_float: torch.Tensor, x: torch.Tensor, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    h, d = HessianAccumulator(x.shape[1]), CrossAccumulator(x.shape[1])
    for cf, c in zip(x_float.split(batch), x.split(batch), strict=True):
        h.add_batch(c)
        d.add_batch(cf, c)
    return h.hessian, d.cross


def test_cross_term_is_a_running_mean_of_the_input_gap() -> None:
    x_float, x = _inputs()
    _, d_chunked = _stats(x_float, x, batch=700)
    _, d_whole = _stats(x_float, x, batch=len(x))
    torch.testing.assert_close(d_chunked, d_whole, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(d_whole, 2 * (x_float - x).t() @ x / len(x), rtol=1e-4, atol=1e-5)


def test_target_is_the_least_squares_fit_of_the_float_output() -> None:
    x_float, x = _inputs()
    w = torch.randn(20, 48, generator=torch.Generator().manual_seed(1))
    h, d = _stats(x_float, x, batch=1000)
    target = asymmetric_target(w, h, d, damp=1e-6)
    fit = torch.linalg.lstsq(x.double(), (x_float @ w.t()).double()).solution.t().float()  # argmin ||X_f W^T - X W'^T||
    torch.testing.assert_close(target, fit, rtol=2e-3, atol=2e-4)
    # hence for any Q: error against the float output = the fit's residual + GPTQ's own objective
    q = w + 0.05 * torch.randn(w.shape, generator=torch.Generator().manual_seed(2))
    total = ((x_float @ w.t() - x @ q.t()) ** 2).sum()
    split = ((x_float @ w.t() - x @ target.t()) ** 2).sum() + ((x @ (target - q).t()) ** 2).sum()
    torch.testing.assert_close(total, split, rtol=1e-3, atol=0.0)
    # the damping shrinks only the correction: equal inputs give W back exactly
    h0, d0 = _stats(x_float, x_float, batch=1000)
    assert torch.equal(d0, torch.zeros_like(d0))
    torch.testing.assert_close(asymmetric_target(w, h0, d0, damp=1.0), w, rtol=0, atol=1e-6)
    # and more damping moves the target towards W
    far = (asymmetric_target(w, h, d, damp=10.0) - w).norm()
    near = (target - w).norm()
    assert 0 < far < near


def test_layer_pair_runs_both_models_and_sees_their_input_gap(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json

    from halfbyte.model.config import ModelConfig
    from halfbyte.model.rope import RotaryEmbedding
    from halfbyte.quant.layer_forward import UNITS, TensorSource, read_layer, run_layer, run_layer_pair
    from tests.test_convert import make_model

    d = make_model(tmp_path / "m", layers=1)
    cfg = ModelConfig.from_hf(json.loads((d / "config.json").read_text()))
    lw = read_layer(TensorSource(d), 0)
    rotary = RotaryEmbedding(cfg.rope_scaling, cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings,
                             torch.device("cpu"), torch.float32)
    lengths = [24, 40]
    g = torch.Generator().manual_seed(0)
    stream = torch.randn(sum(lengths), cfg.hidden_size, generator=g)
    float_out = run_layer(cfg, lw, stream, lengths, rotary, lambda u, h, w: w)
    halved = {u: 0.5 * w for u, w in lw.matrices.items()}  # a stand-in for quantized weights
    quant_out = run_layer(cfg, lw, stream, lengths, rotary, lambda u, h, w: halved[u])
    seen: dict[str, torch.Tensor] = {}

    def process(unit: str, h: torch.Tensor, d: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        seen[unit] = d
        return halved[unit]

    # same stream in: the first matrix's inputs agree (D = 0); the later ones differ, as the
    # halved weights before them changed their inputs
    q, f = run_layer_pair(cfg, lw, stream, stream.clone(), lengths, rotary, process)
    torch.testing.assert_close(q, quant_out)
    torch.testing.assert_close(f, float_out)
    assert torch.equal(seen[UNITS[0]], torch.zeros_like(seen[UNITS[0]]))
    assert all(float(seen[u].abs().max()) > 0 for u in UNITS[1:])
