"""Multi-LoRA on CUDA: the Triton shrink/expand at Llama-3.1-8B's projection shapes against their
twins (bf16), and an engine whose decodes replay the LoRA decode graphs giving the greedy tokens
of the merged weights (fp32: no near ties), adapters and base rows in one batch."""

from __future__ import annotations

import pytest
import torch

from kernels import lora_reference as ref
from kernels.triton import lora as kt
from llmesh import LLM, LoRARequest, SamplingParams
from tests.helpers.lora_adapters import make_peft_adapter, merge_adapter
from tests.helpers.tiny_models import make_tiny_model

pytestmark = pytest.mark.gpu


def _rows(slots: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    order = torch.argsort(slots, stable=True)
    perm = order[slots[order] >= 0].to(torch.int32)
    starts = torch.zeros(num_slots + 1, dtype=torch.int32)
    starts[1:] = torch.cumsum(torch.bincount(slots[slots >= 0], minlength=num_slots), 0)
    return perm.cuda(), starts.cuda()


@pytest.mark.parametrize(("k", "segs"), [(4096, [4096, 1024, 1024]), (4096, [14336, 14336]), (14336, [4096])])
def test_kernels_match_twins_at_8b_shapes(k: int, segs: list[int]) -> None:
    num_slots, r, t = 8, 16, 64
    slots = torch.randint(-1, num_slots, (t,))
    perm, starts = _rows(slots, num_slots)
    x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
    a = (torch.randn(num_slots, len(segs) * r, k, device="cuda") * k**-0.5).to(torch.bfloat16)
    b = (torch.randn(num_slots, sum(segs), r, device="cuda") * 0.05).to(torch.bfloat16)
    seg_starts = torch.tensor([0, *torch.tensor(segs).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    y = kt.lora_shrink(x, a, perm, starts, max_rows=t)
    y_ref = ref.lora_shrink(x, a, perm, starts)
    lora = perm.long()
    torch.testing.assert_close(y.sum(0)[lora], y_ref[0, lora], atol=2e-2, rtol=2e-2)
    base = torch.randn(t, sum(segs), device="cuda", dtype=torch.bfloat16)
    out = kt.lora_expand(y_ref, b, base.clone(), perm, starts, seg_starts, t, max(segs))
    want = ref.lora_expand(y_ref, b, base.clone(), perm, starts, seg_starts)
    torch.testing.assert_close(out, want, atol=3e-2, rtol=3e-2)
    assert torch.equal(out[slots.cuda() < 0], base[slots.cuda() < 0])


def test_lora_decode_graphs_give_the_merged_weights_tokens(tmp_path) -> None:
    base = make_tiny_model(tmp_path / "base", "llama")
    adapters = [make_peft_adapter(tmp_path / f"a{i}", base, r=8, seed=i + 1) for i in range(3)]
    prompts = [[5 + i, 17, 33, 9 * i + 1, 101, 7] for i in range(5)]
    loras = [None, *(LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(adapters)), None]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    kw = dict(device="cuda", dtype="float32", num_kv_blocks=64, max_num_seqs=8)

    def greedy(llm: LLM, ps, lora=None) -> list[list[int]]:
        outs = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False, lora_request=lora)
        return [o.outputs[0].token_ids for o in outs]

    served = LLM(base, enable_lora=True, max_loras=4, **kw)
    ex = served.engine.runner.executor
    assert ex.lora_graphs is not None and ex.lora_graphs.graphs  # captured
    replays: list[int] = []
    with_rows = ex.lora_graphs.with_rows
    ex.lora_graphs.with_rows = lambda rows: replays.append(len(rows)) or with_rows(rows)  # type: ignore[method-assign]
    got = greedy(served, prompts, loras)
    assert replays  # decodes with adapter rows replayed the LoRA graphs
    plain = LLM(base, **kw)
    assert [got[0], got[4]] == greedy(plain, [prompts[0], prompts[4]])
    for i, path in enumerate(adapters):
        merged = LLM(merge_adapter(base, path, tmp_path / f"m{i}"), **kw)
        assert got[i + 1] == greedy(merged, [prompts[i + 1]])[0], f"adapter {i}"
