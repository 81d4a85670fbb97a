"""A worker service without a model: the real Step stream, a runner that samples instantly.

    python benchmarks/null_worker.py --host 127.0.0.1 --port P --scheduler HOST:PORT [--max-num-seqs N]
        [--cost-model none|h100-8b]
    python benchmarks/null_worker.py --smoke     # plans through the worker's StepPipeline, no service

It registers with the scheduler like `llmesh worker` and answers every plan at once with one
token per sequence that reaches its end (token ids cycle through the vocabulary), so a
benchmark driving the scheduler through it measures the scheduler, the wire and the clients,
not a model: the most tokens per second the rest of the mesh can carry
(`benchmarks/scheduler_bound.py`). Nothing here is part of the product.

`--cost-model h100-8b` (default `none`: no delay) makes each step take what it would on an H100
running Llama-3.1-8B (`benchmarks/step_cost.py`: prefill per uncached token, decode by batch
size): a launched step carries a deadline, steps queue one after the other as on one device,
and the step loop waits for that deadline *or* the next plan as it waits for a CUDA event
(`StepPipeline.pending_event`; the wait is a sleep on the loop's watcher thread, the event loop
and the step thread stay free). Routing and scale-out can then be measured with 8-64 simulated
workers on one host.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.step_cost import COST_MODELS, StepCost  # noqa: E402
from services.step import StepPlan, StepResult, WorkerInfo  # noqa: E402
from worker_svc.config import WorkerConfig  # noqa: E402

VOCAB = 49152


@dataclass
class _Seq:
    known: int  # tokens the worker holds
    computed: int


class _Deadline:
    """A simulated device's end of a step: what the step loop reads of a CUDA event."""

    def __init__(self, at: float) -> None:
        self.at = at  # time.monotonic() when the step's "device work" is done

    def synchronize(self) -> None:
        delay = self.at - time.monotonic()
        if delay > 0:
            time.sleep(delay)

    def query(self) -> bool:
        return time.monotonic() >= self.at


@dataclass
class _Sampled:
    """What `StepPipeline.pending_event` reads of `LaunchedStep.sampled`."""

    done_event: _Deadline


@dataclass
class _Launched:
    """What `StepPipeline` reads of a `LaunchedStep`: no device work, so nothing to wait on
    unless a cost model gives the step a deadline."""

    result: StepResult
    sampling: list[str] = field(default_factory=list)
    # `LaunchedStep.sampled`; None: `pending_event` has no event to await (no cost model).
    sampled: _Sampled | None = None
    masks: None = None  # `LaunchedStep.masks`: no structured outputs, so never a deferred sampling
    chunks: list[tuple[int, int]] = field(default_factory=list)  # prefill (start, tokens)
    decodes: int = 0


class NullRunner:
    """What the worker servicer and `StepPipeline` use of a `ModelRunner`, without a model."""

    dtype = "null"
    device = "null"

    # The step cost model (`step_cost.COST_MODELS`); main() sets it from --cost-model.
    cost: StepCost | None = None

    def __init__(self, config: WorkerConfig, kv_store=None, on_rank_failure=None) -> None:  # noqa: ANN001
        self.config = config
        self._device_free_at = 0.0  # when the simulated device finishes the steps launched so far
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
        if self.cost is not None:
            seconds = self.cost.seconds(launched.chunks, launched.decodes)
            # Steps run one after the other on the device: this one starts when the last ends.
            self._device_free_at = max(time.monotonic(), self._device_free_at) + seconds
            launched.sampled = _Sampled(_Deadline(self._device_free_at))
        return launched

    def _advance(self, launched: _Launched, seq_id: str, num_new: int) -> None:
        seq = self.seqs[seq_id]
        if num_new == 1 and seq.computed + 1 >= seq.known:  # one token at the end: a decode
            launched.decodes += 1
        elif num_new > 0:  # uncached tokens after `computed` (cached ones are not planned)
            launched.chunks.append((seq.computed, num_new))
        seq.computed += num_new
        if seq.computed >= seq.known:  # reached its end: it samples (the token joins at once)
            seq.known += 1
            launched.sampling.append(seq_id)

    def finish(self, launched: _Launched) -> StepResult:
        if launched.sampled is not None:
            launched.sampled.done_event.synchronize()  # read only once the "device" is done
        result = launched.result
        result.seq_ids = launched.sampling
        first = self._next_token
        self._next_token = (first + len(launched.sampling)) % (VOCAB - 2)
        result.token_ids = [2 + (first + i) % (VOCAB - 2) for i in range(len(launched.sampling))]
        result.logprobs = [None] * len(launched.sampling)
        return result


def smoke(cost_model: str = "none") -> int:
    """Plans through the worker's own `StepPipeline` (what the Step servicer drives), no service:
    two sequences prefill, then decode three steps, each launched before the previous is read.
    With a cost model, the plans take at least the model's time."""
    from services.sampling_params import SamplingParams
    from services.step import NewSequence, ScheduledSequence
    from worker_svc.pipeline import StepPipeline

    runner = NullRunner(WorkerConfig())
    runner.cost = COST_MODELS[cost_model]
    pipeline = StepPipeline(runner)  # type: ignore[arg-type]
    ids = ["a", "b"]
    plans = [StepPlan(step_id=1, new_seqs=[
        NewSequence(i, [5, 6, 7, 8], 4, [n], 0, 4, SamplingParams(max_tokens=4)) for n, i in enumerate(ids)
    ])]  # fmt: skip
    plans += [StepPlan(step_id=s, scheduled=[ScheduledSequence(i, 1) for i in ids]) for s in (2, 3, 4)]
    results = []
    start = time.monotonic()
    for plan in plans:
        results += pipeline.push(plan)
        # What the servicer reads between plans (`StepLoop._next_item`): None, nothing to await;
        # with a cost model, the step's deadline (waited for like a CUDA event).
        assert (pipeline.pending_event is None) == (runner.cost is None)
    results += pipeline.flush()
    elapsed = time.monotonic() - start
    print(f"cost model {cost_model}: {1000 * elapsed:.1f} ms")
    print(f"{'step':>5}  sequences  tokens")
    for r in results:
        assert not isinstance(r, Exception), r
        print(f"{r.step_id:>5}  {','.join(r.seq_ids):>9}  {r.token_ids}")
    ok = [r.step_id for r in results] == [1, 2, 3, 4] and all(r.seq_ids == ids for r in results)
    print(f"every plan answered with one token per sequence: {'yes' if ok else 'NO'}")
    if runner.cost is not None:  # one 4-token prefill of 2 prompts, then 3 decode steps of 2
        expected = runner.cost.seconds([(0, 4), (0, 4)], 0) + 3 * runner.cost.decode_seconds(2)
        timed = elapsed >= expected * 0.99
        print(f"took at least the model's {1000 * expected:.1f} ms: {'yes' if timed else 'NO'}")
        ok = ok and timed
    return 0 if ok else 1


def _cost_model(argv: list[str]) -> tuple[str, list[str]]:
    """--cost-model NAME (or =NAME) taken out of argv; the rest goes to the worker's own parser."""
    rest, name, i = [], "none", 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--cost-model" and i + 1 < len(argv):
            name, i = argv[i + 1], i + 2
            continue
        if arg.startswith("--cost-model="):
            name = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        i += 1
    if name not in COST_MODELS:
        sys.exit(f"--cost-model: one of {', '.join(COST_MODELS)}, not {name!r}")
    return name, rest


def main() -> int:
    cost_model, argv = _cost_model(sys.argv[1:])
    if "--smoke" in argv:
        return smoke("none") or smoke("h100-8b")
    import worker_svc.service as service

    NullRunner.cost = COST_MODELS[cost_model]
    scale = float(os.environ.get("LLMESH_NULL_COST_SCALE", "1"))  # a slower simulated GPU (routing.py)
    if NullRunner.cost is not None and scale != 1:
        NullRunner.cost = StepCost(
            *(scale * getattr(NullRunner.cost, f) for f in ("a", "b", "c", "d0", "d1"))
        )
    service.ModelRunner = NullRunner  # type: ignore[misc, assignment]
    return service.main(argv)


if __name__ == "__main__":
    sys.exit(main())
