"""Multi-LoRA on the CPU: adapters served from slots give the greedy tokens of the base weights
merged with each adapter, with four adapters and the base model in one batch."""

from __future__ import annotations

import pytest

from llmesh import LLM, LoRARequest, SamplingParams
from tests.helpers.lora_adapters import make_peft_adapter, merge_adapter
from tests.helpers.tiny_models import make_tiny_model

PROMPTS = [[(5 * i + 7 * j) % 400 + 20 for j in range(n)] for i, n in enumerate([9, 23, 5, 40, 17, 31])]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[str]]:
    root = tmp_path_factory.mktemp("lora")
    base = make_tiny_model(root / "base", "llama")
    adapters = [
        make_peft_adapter(root / "all", base, r=8, lora_alpha=16, seed=1),
        make_peft_adapter(root / "qv", base, r=4, lora_alpha=8, targets=["q_proj", "v_proj"], seed=2),
        make_peft_adapter(
            root / "mlp",
            base,
            r=8,
            lora_alpha=4,
            targets=["gate_proj", "up_proj", "down_proj"],
            seed=3,
            use_rslora=True,
        ),
        make_peft_adapter(root / "ko", base, r=16, lora_alpha=16, targets=["k_proj", "o_proj"], seed=4),
    ]
    return base, adapters


def _greedy(llm: LLM, prompts: list[list[int]], lora=None) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False, lora_request=lora)
    return [o.outputs[0].token_ids for o in outs]


def test_adapters_in_one_batch_match_their_merged_weights(lora_setup, tmp_path) -> None:
    base, adapters = lora_setup
    loras = [LoRARequest(f"a{i}", i + 1, path) for i, path in enumerate(adapters)]
    # Base, the four adapters, and the base again: one batch.
    per_prompt = [None, *loras, None]
    served = LLM(base, enable_lora=True, max_loras=4, max_lora_rank=16, num_kv_blocks=64)
    got = _greedy(served, PROMPTS, per_prompt)
    assert _greedy(LLM(base, num_kv_blocks=64), [PROMPTS[0], PROMPTS[5]]) == [got[0], got[5]]
    for i, path in enumerate(adapters):
        merged = LLM(merge_adapter(base, path, tmp_path / f"merged{i}"), num_kv_blocks=64)
        want = _greedy(merged, [PROMPTS[i + 1]])[0]
        assert got[i + 1] == want, f"adapter {i}"
        # The adapter changed the model: not the base model's tokens.
        assert got[i + 1] != _greedy(served, [PROMPTS[i + 1]])[0], f"adapter {i} had no effect"


def test_slots_are_reused_least_recently_used_first(lora_setup) -> None:
    base, adapters = lora_setup
    served = LLM(base, enable_lora=True, max_loras=2, max_lora_rank=16, num_kv_blocks=64)
    loras = [LoRARequest(f"a{i}", i + 1, path) for i, path in enumerate(adapters)]
    first = [_greedy(served, [PROMPTS[1]], lora)[0] for lora in loras]
    # Four adapters through two slots, in every batch at most two adapters (the planner's limit).
    again = _greedy(served, [PROMPTS[1]] * 4, loras)
    assert again == first
    slots = served.engine.runner.executor.lora
    assert len(slots.loaded) == 2


def test_an_unservable_adapter_is_refused_before_anything_runs(lora_setup, tmp_path) -> None:
    base, adapters = lora_setup
    served = LLM(base, enable_lora=True, num_kv_blocks=64, max_lora_rank=8)
    with pytest.raises(ValueError, match="adapter_config.json"):
        served.generate([[5, 6]], GREEDY, lora_request=LoRARequest("x", 1, str(tmp_path)))
    with pytest.raises(ValueError, match="rank 16, above max_lora_rank 8"):
        served.generate([[5, 6]], GREEDY, lora_request=LoRARequest("ko", 1, adapters[3]))
    with pytest.raises(ValueError, match="enable_lora"):
        LLM(base, num_kv_blocks=16).generate([[5, 6]], GREEDY, lora_request=LoRARequest("a", 1, adapters[0]))


def test_an_adapter_never_shares_cached_blocks_with_the_base_or_another(lora_setup) -> None:
    base, adapters = lora_setup
    llm = LLM(base, enable_lora=True, num_kv_blocks=64)
    prompt = list(range(20, 60))  # two full blocks of 16 can be cached

    def cached(lora: LoRARequest | None) -> int:
        return llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=lora)[0].num_cached_tokens

    a, b = LoRARequest("a", 1, adapters[0]), LoRARequest("b", 2, adapters[1])
    assert cached(None) == 0
    assert cached(a) == 0  # the base model's blocks hold other KV
    assert cached(b) == 0
    assert cached(LoRARequest("a", 1, adapters[1])) == 0  # the same name, another folder
    assert (cached(a), cached(None), cached(b)) == (32, 32, 32)


def test_lora_decode_graphs_static_path_equals_eager(lora_setup) -> None:
    """The LoRA decode graphs' padded static-buffer path (run eagerly here: no GPU to capture on)
    gives the eager path's tokens, with adapters and base rows mixed in each decode."""
    from worker_svc.lora.graphs import LoRADecodeGraphs

    base, adapters = lora_setup
    loras = [None, LoRARequest("a0", 1, adapters[0]), LoRARequest("a2", 3, adapters[2])]
    prompts = [[7, 8, 9], [30, 31, 32, 33], [50, 51]]  # short: the interpreter runs the attention
    kw = dict(enable_lora=True, max_loras=2, max_lora_rank=16, num_kv_blocks=64, max_num_seqs=4)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    def greedy(llm: LLM) -> list[list[int]]:
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=loras
        )
        return [o.outputs[0].token_ids for o in outs]

    want = greedy(LLM(base, **kw))
    llm = LLM(base, attention_backend="triton", **kw)
    ex = llm.engine.runner.executor
    ex.lora_graphs = LoRADecodeGraphs(ex, [1, 2, 4], ex.lora, capture=False)
    ex.lora_graphs.kernel_places_inputs = True  # inputs placed as on CUDA (the kernel, interpreted)
    replays = []
    with_rows = ex.lora_graphs.with_rows
    ex.lora_graphs.with_rows = lambda rows: replays.append(len(rows)) or with_rows(rows)  # type: ignore[method-assign]
    assert greedy(llm) == want
    assert 3 in replays  # decodes of 3 sequences (padded to 4) replayed the LoRA graphs' path


def test_lora_modules_are_loaded_at_start(lora_setup) -> None:
    base, adapters = lora_setup
    llm = LLM(base, lora_modules=[f"sql={adapters[0]}", f"chat={adapters[1]}"], num_kv_blocks=16)
    slots = llm.engine.runner.executor.lora
    assert slots is not None and slots.loaded == [("sql", adapters[0]), ("chat", adapters[1])]
    assert llm.engine.info.max_loras == 4 and llm.engine.info.max_lora_rank == 16
