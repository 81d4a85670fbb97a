"""The skinny GEMM's place in the linear layers: only inside a decode graph's scope, only for
few rows, the bias and the fp32 output kept (the kernel runs under Triton's interpreter here)."""

from __future__ import annotations

import json

import pytest
import torch

from kernels import reference
from kernels.triton.skinny_gemm import SkinnyConfig
from worker_svc import decode_gemms
from worker_svc.decode_gemms import CACHE_FILE, CUBLAS, MIN_GAIN, candidates, choose_decode_gemms
from worker_svc.models.parallel_layers import (
    SKINNY_MAX_ROWS,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    decode_graph_gemms,
)
from worker_svc.parallel import TensorParallel

CFG = SkinnyConfig(block_n=16, block_k=64)


def _qkv(bias: bool) -> QKVParallelLinear:
    torch.manual_seed(0)
    layer = QKVParallelLinear(64, 32, 16, bias, TensorParallel())
    torch.nn.init.normal_(layer.weight, std=0.1)
    if bias:
        torch.nn.init.normal_(layer.bias, std=0.1)
    return layer


def test_outside_a_decode_graph_the_layer_is_cublas_bit_for_bit() -> None:
    layer = _qkv(bias=True)
    layer.decode_gemm = CFG
    x = torch.randn(3, 64)
    assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))


def test_inside_a_decode_graph_few_rows_take_the_skinny_gemm_with_the_bias() -> None:
    layer = _qkv(bias=True)
    layer.decode_gemm = CFG
    x = torch.randn(3, 64)
    with decode_graph_gemms():
        out = layer(x)
    expected = reference.linear(x, layer.weight) + layer.bias
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_a_decode_graphs_gate_up_layer_does_silu_and_mul_in_its_gemm() -> None:
    """Inside a decode graph's scope the gate|up layer returns SiLU(gate) * up from its skinny
    GEMM, the bits of the GEMM then SiLU·mul's kernel; elsewhere (outside the scope, the
    library's rows, a bias) it declines and the MLP runs the two as before."""
    import kernels.triton as kt

    torch.manual_seed(0)
    layer = MergedColumnParallelLinear(64, 24, False, TensorParallel()).to(torch.bfloat16)
    torch.nn.init.normal_(layer.weight, std=0.1)
    layer.decode_gemm = CFG
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    assert layer.decode_silu_and_mul(x) is None
    with decode_graph_gemms():
        fused = layer.decode_silu_and_mul(x)
        assert torch.equal(fused, kt.silu_and_mul(layer(x)))
        assert layer.decode_silu_and_mul(torch.randn(SKINNY_MAX_ROWS + 1, 64, dtype=torch.bfloat16)) is None
        biased = MergedColumnParallelLinear(64, 24, True, TensorParallel())
        biased.decode_gemm = CFG
        assert biased.decode_silu_and_mul(x.float()) is None


def test_more_rows_than_the_skinny_limit_stay_on_cublas() -> None:
    layer = _qkv(bias=False)
    layer.decode_gemm = CFG
    x = torch.randn(SKINNY_MAX_ROWS + 1, 64)
    with decode_graph_gemms():
        out = layer(x)
    assert torch.equal(out, torch.nn.functional.linear(x, layer.weight))


def test_a_layer_without_a_choice_ignores_the_scope() -> None:
    layer = _qkv(bias=False)
    x = torch.randn(2, 64)
    with decode_graph_gemms():
        assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight))


def test_the_scope_is_restored_after_it_ends() -> None:
    layer = _qkv(bias=False)
    layer.decode_gemm = CFG
    x = torch.randn(2, 64)
    with decode_graph_gemms():
        with decode_graph_gemms():
            pass
        inner = layer(x)  # still inside the outer scope
    assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight))
    torch.testing.assert_close(inner, reference.linear(x, layer.weight), atol=1e-5, rtol=1e-5)


def test_row_parallel_at_size_1_keeps_its_bias() -> None:
    torch.manual_seed(1)
    layer = RowParallelLinear(48, 40, True, TensorParallel())
    torch.nn.init.normal_(layer.weight, std=0.1)
    torch.nn.init.normal_(layer.bias, std=0.1)
    layer.decode_gemm = CFG
    x = torch.randn(1, 48)
    with decode_graph_gemms():
        out = layer(x)
    torch.testing.assert_close(out, reference.linear(x, layer.weight) + layer.bias, atol=1e-5, rtol=1e-5)


def test_row_parallel_hands_bf16_products_on_in_fp32_at_size_1() -> None:
    # Every size rounds the residual stream once (in the norm), so size 1 and TP N round alike.
    torch.manual_seed(2)
    layer = RowParallelLinear(48, 40, True, TensorParallel())
    torch.nn.init.normal_(layer.weight, std=0.1)
    torch.nn.init.normal_(layer.bias, std=0.1)
    x = torch.randn(3, 48)
    assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))  # fp32: as before
    layer.to(torch.bfloat16)
    xb = x.to(torch.bfloat16)
    assert layer.out_fp32() and not _qkv(bias=False).to(torch.bfloat16).out_fp32()
    out = layer(xb)
    assert out.dtype == torch.float32
    want = torch.nn.functional.linear(xb.float(), layer.weight.float()) + layer.bias.float()
    torch.testing.assert_close(out, want, atol=2e-2, rtol=1e-2)  # CPU: bf16 GEMM, then widened


def test_a_decode_graphs_layers_fold_the_residual_norm_and_elsewhere_decline() -> None:
    """Inside a decode graph's scope, bf16 layers of few rows take the residual norm into their
    skinny GEMMs: o_proj / down add their product to the stream (the bits of the GEMM's fp32
    output then the norm kernel's add) and write h * g and h's squares; qkv / gate|up read
    those and normalize in their epilogue. Outside the scope, past the skinny rows, with a bias
    or a LoRA, with FP8 weights or a tensor-parallel size over 1, a layer declines and the
    model runs the norm kernels."""
    import kernels.triton as kt

    torch.manual_seed(3)
    o_proj = RowParallelLinear(48, 64, False, TensorParallel()).to(torch.bfloat16)
    qkv = _qkv(bias=False).to(torch.bfloat16)
    for layer in (o_proj, qkv):
        torch.nn.init.normal_(layer.weight, std=0.1)
        layer.decode_gemm = CFG
    x = torch.randn(2, 48, dtype=torch.bfloat16)
    stream = torch.randn(2, 64, dtype=torch.bfloat16)
    norm_w = (1 + torch.randn(64) / 4).to(torch.bfloat16)
    assert not o_proj.folds_norms(x)
    with decode_graph_gemms():
        assert o_proj.folds_norms(x) and qkv.folds_norms(stream)
        added, none, _ = o_proj.decode_add_to(x, stream)
        assert none is None and torch.equal(added, kt.rms_norm(o_proj(x), norm_w, 1e-5, stream)[1])
        h, scaled, squares = o_proj.decode_add_to(x, stream, norm_w)
        assert torch.equal(h, added) and scaled is not None and squares is not None
        normed = qkv.decode_normed(scaled, squares, 1e-5)
        want = qkv(kt.rms_norm(h, norm_w, 1e-5)[0])
        torch.testing.assert_close(normed.float(), want.float(), atol=3e-2, rtol=3e-2)
        assert not qkv.folds_norms(torch.randn(SKINNY_MAX_ROWS + 1, 64, dtype=torch.bfloat16))
        assert not _qkv(bias=True).folds_norms(stream.float())
        qkv.lora = object()  # type: ignore[assignment]
        assert not qkv.folds_norms(stream)
        qkv.lora = None
        qkv.weight_scale = torch.ones(1, 64)
        assert not qkv.folds_norms(stream)
        qkv.weight_scale = None
        qkv.tp = TensorParallel(size=2)
        assert not qkv.folds_norms(stream)


def test_nothing_is_chosen_off_cuda() -> None:
    layer = _qkv(bias=False).to(torch.bfloat16)
    assert choose_decode_gemms([layer], torch.device("cpu")) == []
    assert layer.decode_gemm is None


class _Model(torch.nn.Module):
    """Three layers of one shape (bf16), one of another, one fp32 layer (never a candidate)."""

    def __init__(self) -> None:
        super().__init__()
        tp = TensorParallel()
        self.same = torch.nn.ModuleList([QKVParallelLinear(64, 32, 16, False, tp) for _ in range(3)])
        self.other = RowParallelLinear(48, 40, False, tp)
        self.to(torch.bfloat16)
        self.fp32 = QKVParallelLinear(64, 32, 16, False, tp)


def _timer(times: dict[str, float], calls: list):
    def timer(layers, fp32_out):
        calls.append((tuple(layers[0].weight.shape), len(layers), fp32_out))
        return dict(times)

    return timer


def test_each_shape_is_timed_once_and_its_fastest_kept(tmp_path) -> None:
    names = list(candidates())
    model, calls = _Model(), []
    times = {CUBLAS: 10.0, names[0]: 9.5, names[1]: 8.0, names[2]: 8.5}
    lines = choose_decode_gemms([model], torch.device("cpu"), str(tmp_path), _timer(times, calls))
    assert sorted(calls) == [((40, 48), 1, True), ((64, 64), 3, False)]  # row-parallel: fp32 out
    assert len(lines) == 2
    assert all(str(layer.decode_gemm) == names[1] for layer in model.same)
    assert str(model.other.decode_gemm) == names[1]
    assert model.fp32.decode_gemm is None


@pytest.mark.parametrize("tied", [False, True])
def test_the_lm_head_gets_a_config_and_few_rows_of_logits_take_it(tmp_path, monkeypatch, tied: bool) -> None:
    """The vocabulary projection (a head, or a tied model's embedding) is timed as a shape of its
    own; with a config chosen, logits of up to SKINNY_MAX_ROWS rows come from the skinny GEMM,
    more rows from the library."""
    from worker_svc.models.parallel_layers import vocab_parallel_logits

    names = list(candidates())
    torch.manual_seed(3)
    kind = VocabParallelEmbedding if tied else ParallelLMHead
    head = kind(100, 64, TensorParallel()).to(torch.bfloat16)
    torch.nn.init.normal_(head.weight, std=0.1)
    calls: list = []
    choose_decode_gemms([head], torch.device("cpu"), str(tmp_path), _timer({CUBLAS: 10.0}, calls))
    assert calls == [] and head.decode_gemm is None  # a small matrix: not timed, cuBLAS
    monkeypatch.setattr(decode_gemms, "HEAD_MIN_BYTES", 0)
    choose_decode_gemms(
        [head], torch.device("cpu"), str(tmp_path), _timer({CUBLAS: 10.0, names[0]: 5.0}, calls)
    )
    assert calls == [((100, 64), 1, False)] and str(head.decode_gemm) == names[0]
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    want = reference.linear(x, head.weight)
    torch.testing.assert_close(vocab_parallel_logits(x, head), want, atol=2e-2, rtol=2e-2)
    head.decode_gemm = SkinnyConfig(block_n=16, block_k=32)  # a config that fits 64-wide rows
    few = vocab_parallel_logits(x, head)
    assert few.shape == (3, 100)
    torch.testing.assert_close(few, want, atol=2e-2, rtol=2e-2)
    many = torch.randn(SKINNY_MAX_ROWS + 1, 64, dtype=torch.bfloat16)
    assert torch.equal(vocab_parallel_logits(many, head), torch.nn.functional.linear(many, head.weight))


def test_cublas_stays_unless_beaten_by_the_margin(tmp_path) -> None:
    names = list(candidates())
    model = _Model()
    times = {CUBLAS: 10.0, names[0]: 10.0 * (1 - MIN_GAIN) + 0.01}
    choose_decode_gemms([model], torch.device("cpu"), str(tmp_path), _timer(times, []))
    assert all(layer.decode_gemm is None for layer in model.modules() if hasattr(layer, "decode_gemm"))


def test_the_choices_are_reused_from_the_cache_file_at_the_next_start(tmp_path) -> None:
    names = list(candidates())
    first = {CUBLAS: 10.0, names[2]: 7.0}
    choose_decode_gemms([_Model()], torch.device("cpu"), str(tmp_path), _timer(first, []))
    saved = json.loads((tmp_path / CACHE_FILE).read_text())
    assert sorted(saved.values()) == [names[2], names[2]]
    # A second start whose timings would pick cuBLAS keeps the recorded choice, timing nothing.
    again, calls = _Model(), []
    choose_decode_gemms([again], torch.device("cpu"), str(tmp_path), _timer({CUBLAS: 1.0}, calls))
    assert calls == []
    assert str(again.other.decode_gemm) == names[2]


def test_a_corrupt_cache_file_is_timed_again_and_rewritten(tmp_path) -> None:
    names = list(candidates())
    (tmp_path / CACHE_FILE).write_text("{not json")
    calls: list = []
    choose_decode_gemms(
        [_Model()], torch.device("cpu"), str(tmp_path), _timer({CUBLAS: 10.0, names[0]: 5.0}, calls)
    )
    assert len(calls) == 2
    assert set(json.loads((tmp_path / CACHE_FILE).read_text()).values()) == {names[0]}


def test_an_unwritable_cache_still_chooses(tmp_path) -> None:
    names = list(candidates())
    blocked = tmp_path / "file"
    blocked.write_text("")  # a file where the cache folder should be
    model = _Model()
    choose_decode_gemms(
        [model], torch.device("cpu"), str(blocked / "sub"), _timer({CUBLAS: 10.0, names[0]: 5.0}, [])
    )
    assert str(model.other.decode_gemm) == names[0]


def _fp8_layers(n: int = 2) -> torch.nn.ModuleList:
    from worker_svc.models.fp8 import quantize_weight_fp8

    tp = TensorParallel()
    layers = torch.nn.ModuleList([QKVParallelLinear(64, 32, 16, False, tp) for _ in range(n)]).to(
        torch.bfloat16
    )
    for layer in layers:
        layer.set_fp8_weight(*quantize_weight_fp8(layer.weight.data))
    return layers


def test_fp8_layers_get_a_second_config_for_17_to_64_rows_and_it_is_remembered(tmp_path) -> None:
    """FP8 layers are timed again at WIDE_ROWS rows, every candidate against `_scaled_mm`; the
    fastest there serves the decode graphs of 17 to WIDE_ROWS rows, whatever won at one row."""
    from worker_svc.decode_gemms import WIDE_ROWS

    names = list(candidates())
    at64 = {f"{CUBLAS}@{WIDE_ROWS}": 30.0, f"{names[1]}@{WIDE_ROWS}": 29.9, f"{names[2]}@{WIDE_ROWS}": 20.0}
    layers = _fp8_layers()
    lines = choose_decode_gemms(
        [layers], torch.device("cpu"), str(tmp_path), _timer({CUBLAS: 10.0, names[1]: 5.0, **at64}, [])
    )
    assert all(str(x.decode_gemm) == names[1] and str(x.decode_gemm_wide) == names[2] for x in layers)
    assert f"17-{WIDE_ROWS} rows: {names[2]}" in lines[0]
    again, calls = _fp8_layers(), []
    choose_decode_gemms([again], torch.device("cpu"), str(tmp_path), _timer({CUBLAS: 1.0}, calls))
    assert calls == [] and str(again[0].decode_gemm_wide) == names[2]
    # The library winning at 64 rows leaves those rows to it; bf16 layers get no second config.
    loses = {CUBLAS: 10.0, names[1]: 5.0, f"{CUBLAS}@{WIDE_ROWS}": 20.0, f"{names[2]}@{WIDE_ROWS}": 19.9}
    third, bf16 = _fp8_layers(), _Model()
    choose_decode_gemms([third, bf16], torch.device("cpu"), str(tmp_path / "new"), _timer(loses, []))
    assert third[0].decode_gemm_wide is None and str(third[0].decode_gemm) == names[1]
    assert all(x.decode_gemm_wide is None for x in bf16.modules() if hasattr(x, "decode_gemm_wide"))


def test_an_fp8_entry_from_before_the_second_timing_is_timed_again_keeping_its_choice(tmp_path) -> None:
    """Caches written before the wide choice existed hold "64" (or nothing) beside an FP8 choice:
    the shape is timed again for its wide config, and its batch-1 choice stays as recorded."""
    from worker_svc.decode_gemms import WIDE_ROWS

    names = list(candidates())
    choose_decode_gemms(
        [_fp8_layers()], torch.device("cpu"), str(tmp_path), _timer({CUBLAS: 10.0, names[0]: 5.0}, [])
    )
    saved = json.loads((tmp_path / CACHE_FILE).read_text())
    (tmp_path / CACHE_FILE).write_text(
        json.dumps({k: WIDE_ROWS if k.endswith(f"@{WIDE_ROWS}") else v for k, v in saved.items()})
    )
    layers, calls = _fp8_layers(), []
    wins = {CUBLAS: 10.0, names[1]: 1.0, f"{CUBLAS}@{WIDE_ROWS}": 30.0, f"{names[3]}@{WIDE_ROWS}": 20.0}
    choose_decode_gemms([layers], torch.device("cpu"), str(tmp_path), _timer(wins, calls))
    assert len(calls) == 1
    assert str(layers[0].decode_gemm) == names[0] and str(layers[0].decode_gemm_wide) == names[3]


def test_a_layer_runs_its_wide_config_from_17_to_64_rows_and_the_library_beyond() -> None:
    layer = _qkv(bias=False)
    layer.decode_gemm_wide = CFG  # and no batch-1 config: up to 16 rows stay on the library
    for rows, skinny in ((SKINNY_MAX_ROWS, False), (SKINNY_MAX_ROWS + 1, True), (64, True), (65, False)):
        x = torch.randn(rows, 64)
        with decode_graph_gemms():
            out = layer(x)
        if skinny:
            torch.testing.assert_close(out, reference.linear(x, layer.weight), atol=1e-5, rtol=1e-5)
            assert not torch.equal(out, torch.nn.functional.linear(x, layer.weight))  # not cuBLAS's sums
        else:
            assert torch.equal(out, torch.nn.functional.linear(x, layer.weight))
