"""LoRA adapters at tensor-parallel size 2 on the CPU (gloo rank processes): each rank loads its
shard of an adapter into the slot rank 0 chose (LORA_LOAD on the rank channel) and gets each
step's row slots with its inputs; greedy tokens equal size 1's, adapters and base in one batch."""

from __future__ import annotations

from llmesh import LLM, LoRARequest, SamplingParams
from tests.helpers.lora_adapters import make_peft_adapter
from tests.helpers.tiny_models import make_tiny_model

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [100, 200, 300], list(range(20, 60)), [7, 7, 7]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def test_adapters_at_size_2_equal_size_1(tmp_path) -> None:
    base = make_tiny_model(tmp_path / "llama", "llama", seed=3)
    qv = ["q_proj", "v_proj", "o_proj", "down_proj"]  # column- and row-parallel layers both
    adapters = [
        make_peft_adapter(tmp_path / "all", base, r=8, seed=1),
        make_peft_adapter(tmp_path / "some", base, r=4, lora_alpha=8, targets=qv, seed=2),
    ]
    loras = [None, LoRARequest("all", 1, adapters[0]), LoRARequest("some", 2, adapters[1]), None]
    kw = dict(enable_lora=True, max_loras=2, max_lora_rank=8, kv_cache_memory=1 << 22, max_num_seqs=4)

    def greedy(size: int) -> list[list[int]]:
        llm = LLM(base, tensor_parallel_size=size, **kw)
        try:
            outs = llm.generate(
                [{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False, lora_request=loras
            )
            return [o.outputs[0].token_ids for o in outs]
        finally:
            llm.engine.close()

    want = greedy(1)
    assert greedy(2) == want
