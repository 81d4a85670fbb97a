"""The skinny GEMM's place in the linear layers: only inside a decode graph's scope, only for
few rows, the bias and the fp32 output kept (the kernel runs under Triton's interpreter here)."""

from __future__ import annotations

import torch

from kernels import reference
from kernels.triton.skinny_gemm import SkinnyConfig
from worker_svc.decode_gemms import choose_decode_gemms
from worker_svc.models.parallel_layers import (
    SKINNY_MAX_ROWS,
    QKVParallelLinear,
    RowParallelLinear,
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


def test_nothing_is_chosen_off_cuda() -> None:
    layer = _qkv(bias=False)
    assert choose_decode_gemms([layer], torch.device("cpu")) == []
    assert layer.decode_gemm is None
