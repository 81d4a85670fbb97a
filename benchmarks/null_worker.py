"""A worker service without a model: the real Step stream, a runner that samples instantly.

    python benchmarks/null_worker.py --host 127.0.0.1 --port P --scheduler HOST:PORT [--max-num-seqs N]
    python benchmarks/null_worker.py --smoke     # plans through the worker's StepPipeline, no service

It registers with the scheduler like `llmesh worker` and answers every plan at once with one
token per sequence that reaches its end (token ids cycle through the vocabulary), so a
benchmark driving the scheduler through it measures the scheduler, the wire and the clients,
not a model: the most tokens per second the rest of the mesh can carry
(`benchmarks/scheduler_bound.py`). Nothing here is part of the product.
"""

from __future__ import annotations

import hashlib
import os
import sys
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from services.step import StepPlan, StepResult, WorkerInfo  # noqa: E402
from worker_svc.config import WorkerConfig  # noqa: E402

VOCAB = 49152


@dataclass
class _Seq:
    known: int  # tokens the worker holds
    computed: int


@dataclass
class _Launched:
    """What `StepPipeline` reads of a `LaunchedStep`: no device work, so nothing to wait on."""

    result: StepResult
    sampling: list[str] = field(default_factory=list)
    sampled: None = None  # `LaunchedStep.sampled`; None: `pending_event` has no event to await


class NullRunner:
    """What the worker servicer and `StepPipeline` use of a `ModelRunner`, without a model."""

    dtype = "null"
    device = "null"

    def __init__(self, config: WorkerConfig, kv_store=None, on_rank_failure=None) -> None:  # noqa: ANN001
        self.config = config
        self.seqs: dict[str, _Seq] = {}
        self._next_token = 0
        self.info = WorkerInfo(
            model_name="null",
            fingerprint=hashlib.sha256(b"null-worker").digest(),
            block_size=config.block_size,
            num_kv_blocks=config.num_kv_blocks or 1 << 16,
            max_model_len=config.max_model_len or 4096,
            vocab_size=VOCAB,
            eos_token_ids=[],
            max_num_seqs=config.max_num_seqs,
        )

    def drop_all(self) -> None:
        self.seqs.clear()

    def close(self) -> None:
        pass

    def can_follow(self, plan: StepPlan) -> bool:
        return True

    def launch(self, plan: StepPlan) -> _Launched:
        for seq_id in plan.finished_ids + plan.preempted_ids:
            self.seqs.pop(seq_id, None)
        launched = _Launched(StepResult(step_id=plan.step_id))
        steps = [(s.seq_id, len(s.token_ids), s.num_computed_tokens, s.num_new_tokens) for s in plan.new_seqs]
        for seq_id, known, computed, _ in steps:
            self.seqs[seq_id] = _Seq(known, computed)
        for seq_id, _, _, num_new in steps:
            self._advance(launched, seq_id, num_new)
        for s in plan.scheduled:
            if s.seq_id not in self.seqs:
                raise KeyError(f"plan schedules unknown sequence {s.seq_id!r}")
            self._advance(launched, s.seq_id, s.num_new_tokens)
        return launched

    def _advance(self, launched: _Launched, seq_id: str, num_new: int) -> None:
        seq = self.seqs[seq_id]
        seq.computed += num_new
        if seq.computed >= seq.known:  # reached its end: it samples (the token joins at once)
            seq.known += 1
            launched.sampling.append(seq_id)

    def finish(self, launched: _Launched) -> StepResult:
        result = launched.result
        result.seq_ids = launched.sampling
        first = self._next_token
        self._next_token = (first + len(launched.sampling)) % (VOCAB - 2)
        result.token_ids = [2 + (first + i) % (VOCAB - 2) for i in range(len(launched.sampling))]
        result.logprobs = [None] * len(launched.sampling)
        return result


def smoke() -> int:
    """Plans through the worker's own `StepPipeline` (what the Step servicer drives), no service:
    two sequences prefill, then decode three steps, each launched before the previous is read."""
    from services.sampling_params import SamplingParams
    from services.step import NewSequence, ScheduledSequence
    from worker_svc.pipeline import StepPipeline

    pipeline = StepPipeline(NullRunner(WorkerConfig()))  # type: ignore[arg-type]
    ids = ["a", "b"]
    plans = [StepPlan(step_id=1, new_seqs=[
        NewSequence(i, [5, 6, 7, 8], 4, [n], 0, 4, SamplingParams(max_tokens=4)) for n, i in enumerate(ids)
    ])]  # fmt: skip
    plans += [StepPlan(step_id=s, scheduled=[ScheduledSequence(i, 1) for i in ids]) for s in (2, 3, 4)]
    results = []
    for plan in plans:
        results += pipeline.push(plan)
        # What the servicer reads between plans (`StepLoop._next_item`): None, nothing to await.
        assert pipeline.pending_event is None
    results += pipeline.flush()
    print(f"{'step':>5}  sequences  tokens")
    for r in results:
        assert not isinstance(r, Exception), r
        print(f"{r.step_id:>5}  {','.join(r.seq_ids):>9}  {r.token_ids}")
    ok = [r.step_id for r in results] == [1, 2, 3, 4] and all(r.seq_ids == ids for r in results)
    print(f"every plan answered with one token per sequence: {'yes' if ok else 'NO'}")
    return 0 if ok else 1


def main() -> int:
    if "--smoke" in sys.argv[1:]:
        return smoke()
    import worker_svc.service as service

    service.ModelRunner = NullRunner  # type: ignore[misc, assignment]
    return service.main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
