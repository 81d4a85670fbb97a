"""The whole model on the Triton backend, on CPU (every kernel under Triton's interpreter).

A tiny Llama runs through `LLM(..., attention_backend="triton")`: Triton attention, KV write,
fused RMSNorm and rotary, with chunked prefills mixed with decodes. Its greedy output must
equal the reference (torch) backend's. The second test runs the CUDA-graph decode path's
padded static buffers eagerly (no capture on CPU): a batch of 3 padded to 4 rows whose padding
row writes nothing, then 2 and 1, must give the same tokens.
"""

from __future__ import annotations

import pytest

from llmesh import LLM, SamplingParams
from tests.helpers.tiny_models import make_tiny_model
from worker_svc.cuda_graphs import DecodeGraphs

# Lengths 6, 21 (crosses a 16-token block), 3; different output lengths shrink the batch.
PROMPTS = [[5, 17, 33, 9, 101, 7], list(range(40, 61)), [300, 3, 450]]
MAX_TOKENS = [8, 5, 3]
ENGINE = dict(num_kv_blocks=32, block_size=16, max_num_seqs=4, max_num_batched_tokens=16)


def _generate(llm: LLM) -> list[list[int]]:
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in MAX_TOKENS]
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("tiny_triton") / "llama", "llama")


@pytest.fixture(scope="module")
def reference_tokens(tiny: str) -> list[list[int]]:
    return _generate(LLM(tiny, attention_backend="torch", **ENGINE))


def test_triton_backend_greedy_equals_reference(tiny: str, reference_tokens: list[list[int]]) -> None:
    llm = LLM(tiny, attention_backend="triton", **ENGINE)
    assert llm.engine.runner.model.norm.kernel.__module__ == "kernels.triton.rms_norm"
    assert _generate(llm) == reference_tokens


def _count_rows(graphs: DecodeGraphs) -> list[int]:
    """Record the number of input rows of every `graphs.run` call (the list fills as they run)."""
    rows: list[int] = []
    run = graphs.run

    def counting_run(ids, *args):  # type: ignore[no-untyped-def]
        rows.append(len(ids))
        return run(ids, *args)

    graphs.run = counting_run  # type: ignore[method-assign]
    return rows


def _placed_by_kernel(graphs: DecodeGraphs) -> DecodeGraphs:
    """The inputs as CUDA places them: one buffer of host memory (not page-locked here) and the
    kernel that places it (`kernels.triton.pinned_io`, under the interpreter), not its twin."""
    graphs.kernel_places_inputs = True
    return graphs


@pytest.mark.parametrize("by_kernel", [False, True])
def test_padded_static_decode_equals_reference(
    tiny: str, reference_tokens: list[list[int]], by_kernel: bool
) -> None:
    llm = LLM(tiny, attention_backend="triton", **ENGINE)
    runner = llm.engine.runner
    graphs = DecodeGraphs(runner.executor, [1, 2, 4], capture=False)
    if by_kernel:
        _placed_by_kernel(graphs)
    sizes = _count_rows(graphs)
    runner.executor.graphs = graphs
    assert _generate(llm) == reference_tokens
    assert 3 in sizes and 1 in sizes  # padded (3 -> 4) and unpadded decode batches both ran


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_decode_with_the_norms_in_the_skinny_gemms_equals_reference(
    arch: str, tiny: str, reference_tokens: list[list[int]], tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The decode path as a decode graph runs it, every linear layer on a skinny GEMM: the
    layers fold their residual norms into those GEMMs (no norm kernel but the first layer's
    and the final one), and the greedy tokens stay the reference's (fp32 here, so the fold is
    exact to a rounding). Qwen3 adds its q / k norms between the qkv GEMM and the attention."""
    from kernels.triton.skinny_gemm import SkinnyConfig
    from worker_svc.models.llama import DecoderLayer
    from worker_svc.models.parallel_layers import ShardedLinear, decode_graph_gemms

    if arch != "llama":
        tiny = make_tiny_model(tmp_path / arch, arch)
        reference_tokens = _generate(LLM(tiny, attention_backend="torch", **ENGINE))
    llm = LLM(tiny, attention_backend="triton", **ENGINE)
    runner = llm.engine.runner
    for module in runner.model.modules():
        if isinstance(module, ShardedLinear):
            module.decode_gemm = SkinnyConfig(block_n=32, block_k=64)
    graphs = DecodeGraphs(runner.executor, [1, 2, 4], capture=False)
    forward = graphs._forward

    def in_graph_scope(b: int):  # type: ignore[no-untyped-def]
        with decode_graph_gemms():
            return forward(b)

    graphs._forward = in_graph_scope  # type: ignore[method-assign]
    folded = []
    fold = DecoderLayer.forward_norms_in_gemms

    def counting_fold(self, *args):  # type: ignore[no-untyped-def]
        out = fold(self, *args)
        folded.append(self)  # (a step that raised is not counted)
        return out

    monkeypatch.setattr(DecoderLayer, "forward_norms_in_gemms", counting_fold)
    runner.executor.graphs = graphs
    assert _generate(llm) == reference_tokens
    # every layer of every pure-decode step (those the graphs run) folded, without a failure
    layers = len(runner.model.layers)
    assert len(folded) >= 4 * layers and len(folded) % layers == 0


def test_pack_to_device_round_trips_aligned() -> None:
    import numpy as np

    from worker_svc.executor import pack_to_device

    arrays = [
        np.arange(5, dtype=np.int64),
        np.zeros(0, dtype=np.int64),
        np.arange(7, dtype=np.int32) - 3,
        np.arange(12, dtype=np.int32).reshape(3, 4)[:, :3],  # non-contiguous
    ]
    out = pack_to_device(arrays, "cpu")
    for a, t in zip(arrays, out, strict=True):
        assert t.shape == a.shape and t.numpy().dtype == a.dtype
        assert (t.numpy() == a).all()
        assert t.data_ptr() % 16 == 0


@pytest.mark.parametrize("by_kernel", [False, True])
def test_padded_static_verification_equals_reference(tiny: str, by_kernel: bool) -> None:
    """Speculative decoding's verify graphs, run eagerly: q rows per sequence, drafts and padding."""
    prompts = [[5, 6, 7, 8] * 6, [40, 41, 42] * 5]
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)

    def generate(llm: LLM) -> list[list[int]]:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    want = generate(LLM(tiny, attention_backend="torch", **ENGINE))
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    llm = LLM(tiny, attention_backend="triton", speculative_config=spec, **ENGINE)
    runner = llm.engine.runner
    graphs = DecodeGraphs(runner.executor, [1, 2, 4], capture=False, query_len=4)
    if by_kernel:
        _placed_by_kernel(graphs)
    rows = _count_rows(graphs)
    runner.executor.verify_graphs = graphs
    assert generate(llm) == want
    assert rows and all(r % 4 == 0 for r in rows)  # verifications ran as q = 4 rows per sequence
    assert llm.engine.mesh.workers["local"].planner.spec.stats.num_accepted_tokens > 0
