"""Plans in order, each launched before the previous one's sampled ids are read.

`ModelRunner.launch` queues a plan's GPU work; `finish` waits for its sampled
ids. Run one after the other, the host sits idle while the device finishes a
step, then the device sits idle while the host reads the ids, builds the next
inputs and launches them. When the next plan is already at hand (asynchronous
scheduling keeps one ahead), this launches it first: its decode inputs are read
on the device from the step still running, and the device always has the next
step queued. Where the next plan needs a sampled id on the host (penalties,
seeds, min_tokens), the previous step is finished first.
"""

from __future__ import annotations

import torch

from services.step import StepPlan, StepResult
from worker_svc.runner import LaunchedStep, ModelRunner

StepOutcome = StepResult | Exception


class StepPipeline:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self._pending: LaunchedStep | None = None
        self.num_launched_ahead = 0  # plans launched while the one before was still unread

    def bind_thread(self) -> None:
        """The thread that pushes plans launches the runner's kernels: bind it as the runner binds
        its own (its GPU the thread's current device; a runner without the hook needs none)."""
        bind = getattr(self.runner, "bind_thread", None)
        if bind is not None:
            bind()

    @property
    def has_pending(self) -> bool:
        return self._pending is not None

    @property
    def pending_event(self) -> torch.cuda.Event | None:
        """The event after which `flush` no longer waits on the device; None when it never does.

        A caller with nothing to launch waits for this *or* the next plan, whichever comes
        first, rather than in `flush`: a plan that arrives while the step runs is then launched
        at once, and the device does not idle while it is built.
        """
        pending = self._pending
        if pending is None:
            return None
        if pending.masks is not None:  # structured outputs: nothing to launch, so queue its
            try:  # sampling now (its masks were being filled)
                self.runner.sample_deferred(pending)
            except Exception:  # raised again by `flush`, which reports it
                return None
        if pending.sampled is None:
            return None
        return pending.sampled.done_event

    def push(self, plan: StepPlan) -> list[StepOutcome]:
        """Launch `plan`; the outcomes of the plans completed meanwhile, oldest first.

        The previous plan's result comes out here; `plan`'s comes from the next push or from
        `flush`, unless the runner rejects it (KeyError, ValueError), which comes out here too.
        """
        out: list[StepOutcome] = []
        if self._pending is not None and not self.runner.can_follow(plan):
            out.append(self._finish())
        try:
            launched = self.runner.launch(plan)
        except (KeyError, ValueError) as e:
            out.extend(self.flush())
            out.append(e)
            return out
        self.num_launched_ahead += self._pending is not None
        out.extend(self.flush())
        self._pending = launched
        return out

    def flush(self) -> list[StepOutcome]:
        """Finish the step in flight, if any (nothing else is coming for now)."""
        return [self._finish()] if self._pending is not None else []

    def _finish(self) -> StepResult:
        launched, self._pending = self._pending, None
        assert launched is not None
        return self.runner.finish(launched)
