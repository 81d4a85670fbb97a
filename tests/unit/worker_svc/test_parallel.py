"""Tensor parallelism without processes: size checks, the rank channel's bytes, and each rank's
slices of the weights (loaded from a checkpoint, or cut from dummy weights) against size 1's."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from worker_svc.loader import load_model
from worker_svc.models.config import ModelConfig
from worker_svc.p2p_all_reduce import P2PAllReduce
from worker_svc.parallel import TensorParallel, check_shardable, open_group
from worker_svc.rank_channel import DECODE_GRAPH, EAGER, STEP, STOP, ForwardInputs, encode, read_message
from worker_svc.rank_group import start_rank_group


def _config(heads: int, kv_heads: int, intermediate: int = 128) -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=intermediate,
        num_layers=1,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=16,
    )


def test_sizes_that_do_not_divide_the_heads_are_refused_with_the_reason():
    check_shardable(_config(4, 2), 2)
    check_shardable(_config(4, 2), 1)
    with pytest.raises(ValueError, match=r"does not divide the query heads \(9\) and the KV heads \(3\)"):
        check_shardable(_config(9, 3), 2)  # SmolLM2-135M's heads
    with pytest.raises(ValueError, match=r"KV heads \(2\)"):
        check_shardable(_config(4, 2), 3)
    with pytest.raises(ValueError, match=">= 1"):
        check_shardable(_config(4, 2), 0)


def test_the_p2p_all_reduce_stays_off_where_it_cannot_run():
    votes: list[bool] = []

    def agree(ok: bool) -> bool:
        votes.append(ok)
        return ok

    p2p = P2PAllReduce.open(0, 2, None, None, torch.device("cpu"), agree=agree)
    assert p2p is None
    assert votes == [False]  # the ranks agree to stay off before anyone enters a rendezvous
    with pytest.raises(ValueError, match="tp_all_reduce must be auto or nccl"):
        open_group(0, 2, 0, "gloo", 5.0, all_reduce="fast")


def test_a_refused_size_starts_no_process(tiny_model_dirs):
    from worker_svc.config import WorkerConfig

    with pytest.raises(ValueError, match="tensor_parallel_size 3 does not divide"):
        start_rank_group(WorkerConfig(tensor_parallel_size=3), tiny_model_dirs["llama3"])
    assert start_rank_group(WorkerConfig(), tiny_model_dirs["llama3"]) is None


def test_channel_round_trip_keeps_arrays_and_makes_them_writable():
    inputs = ForwardInputs(
        mode=EAGER,
        ids=np.array([5, 6, 7], dtype=np.int64),
        positions=np.array([0, 1, 2], dtype=np.int64),
        slots=np.array([32, 33, 34], dtype=np.int64),
        seq_lens=np.array([3], dtype=np.int32),
        tables=np.array([[2, 0]], dtype=np.int32),
        num_sampled=1,
        sample_index=np.array([2], dtype=np.int64),
        query_start_loc=np.array([0, 3], dtype=np.int32),
        query_lens=np.array([3], dtype=np.int64),
        max_query_len=3,
        max_seq_len=3,
        patch_where=np.array([2], dtype=np.int64),
    )
    f = io.BytesIO(inputs.encode() + encode(STOP, []))
    kind, arrays = read_message(f)
    assert kind == STEP
    got = ForwardInputs.decode(arrays)
    for name in ("ids", "positions", "slots", "seq_lens", "tables", "sample_index", "query_start_loc"):
        a, b = getattr(inputs, name), getattr(got, name)
        assert a.dtype == b.dtype and np.array_equal(a, b), name
    assert (got.mode, got.num_sampled, got.max_query_len, got.max_seq_len) == (EAGER, 1, 3, 3)
    assert got.ids.flags.writeable  # the forward patches in-flight ids into it
    assert read_message(f) == (STOP, [])
    assert read_message(f) is None  # EOF: rank 0 is gone
    none_index = ForwardInputs(DECODE_GRAPH, got.ids, got.positions, got.slots, got.seq_lens, got.tables, 0)
    assert ForwardInputs.decode(read_message(io.BytesIO(none_index.encode()))[1]).sample_index is None


def _ranks(size: int) -> list[TensorParallel]:
    # No group: loading and cutting weights runs no collective.
    return [TensorParallel(rank=r, size=size) for r in range(size)]


@pytest.mark.parametrize("variant", ["qwen2", "llama_tied"])
def test_rank_slices_of_a_checkpoint_rejoin_into_the_size_1_weights(tiny_model_dirs, variant):
    path = tiny_model_dirs[variant]
    full, cfg = load_model(path)
    shards = [load_model(path, tp=tp)[0] for tp in _ranks(2)]
    params = [dict(m.named_parameters()) for m in shards]
    layer = "layers.0."
    qkv = [p[layer + "self_attn.qkv_proj.weight"] for p in params]
    q, kv = cfg.q_size // 2, cfg.kv_size // 2
    ref = full.get_parameter(layer + "self_attn.qkv_proj.weight")
    # Each rank: its q heads, then its k heads, then its v heads.
    assert torch.equal(torch.cat([s[:q] for s in qkv]), ref[: cfg.q_size])
    assert torch.equal(torch.cat([s[q : q + kv] for s in qkv]), ref[cfg.q_size : cfg.q_size + cfg.kv_size])
    assert torch.equal(torch.cat([s[q + kv :] for s in qkv]), ref[cfg.q_size + cfg.kv_size :])
    o = [p[layer + "self_attn.o_proj.weight"] for p in params]
    assert torch.equal(torch.cat(o, dim=1), full.get_parameter(layer + "self_attn.o_proj.weight"))
    down = [p[layer + "mlp.down_proj.weight"] for p in params]
    assert torch.equal(torch.cat(down, dim=1), full.get_parameter(layer + "mlp.down_proj.weight"))
    emb = [p["embed_tokens.weight"] for p in params]
    assert torch.equal(torch.cat(emb)[: cfg.vocab_size], full.get_parameter("embed_tokens.weight"))
    if variant == "qwen2":
        bias = [p[layer + "self_attn.qkv_proj.bias"] for p in params]
        ref_bias = full.get_parameter(layer + "self_attn.qkv_proj.bias")
        assert torch.equal(torch.cat([b[:q] for b in bias]), ref_bias[: cfg.q_size])


def test_dummy_weights_are_the_size_1_weights_cut_per_rank(tiny_model_dirs):
    path = tiny_model_dirs["llama3"]
    full, cfg = load_model(path, load_format="dummy")
    shards = [load_model(path, load_format="dummy", tp=tp)[0] for tp in _ranks(2)]
    gate_up = [m.get_parameter("layers.1.mlp.gate_up_proj.weight") for m in shards]
    i = cfg.intermediate_size // 2
    ref = full.get_parameter("layers.1.mlp.gate_up_proj.weight")
    assert torch.equal(torch.cat([g[:i] for g in gate_up]), ref[: cfg.intermediate_size])
    assert torch.equal(torch.cat([g[i:] for g in gate_up]), ref[cfg.intermediate_size :])
    heads = [m.get_parameter("lm_head.weight") for m in shards]
    assert torch.equal(torch.cat(heads)[: cfg.vocab_size], full.get_parameter("lm_head.weight"))


def test_an_uneven_vocabulary_is_padded_not_refused(tmp_path):
    from tests.helpers.tiny_models import make_tiny_model

    path = make_tiny_model(tmp_path / "odd", "llama", vocab_size=509, head_dim=16)
    full, cfg = load_model(path)
    shards = [load_model(path, tp=tp)[0] for tp in _ranks(2)]
    emb = [m.get_parameter("embed_tokens.weight") for m in shards]
    assert [e.shape[0] for e in emb] == [255, 255]
    assert torch.equal(torch.cat(emb)[:509], full.get_parameter("embed_tokens.weight"))
    assert not emb[1][-1].any()  # the padding row


def test_logits_rows_are_padded_to_few_shapes_and_cut_back(tiny_model_dirs):
    from worker_svc.models.parallel_layers import logits_rows

    assert [logits_rows(n) for n in (0, 1, 3, 8, 9, 64, 65, 1000)] == [0, 1, 4, 8, 16, 64, 128, 1024]
    assert len({logits_rows(n) for n in range(1, 1025)}) == 7 + 15  # 1..64, then 128..1024
    model, _ = load_model(tiny_model_dirs["llama3"])
    hidden = torch.randn(5, model.get_parameter("embed_tokens.weight").shape[1])
    logits = model.compute_logits(hidden)
    assert logits.shape[0] == 5
    torch.testing.assert_close(logits, torch.stack([model.compute_logits(h[None])[0] for h in hidden]))
