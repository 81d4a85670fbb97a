"""Pick the worker for a new request: longest cached prefix first, then least load.

A worker's cached prefix counts its GPU cache and then its host (CPU) tier: both are local
loads. What the shared KV store holds, every worker can load alike, so it does not count.

A worker whose queue is far longer than the least-loaded one loses its prefix
advantage: recomputing a prefix is cheaper than waiting behind a long queue.
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler_svc.lora import LoRAKey
from scheduler_svc.planner import Planner
from scheduler_svc.prefix_hash import ROOT_KEY


@dataclass
class RouteChoice:
    worker_id: str
    cached_tokens: int
    load: int
    holds_lora: bool = False  # the worker ran the request's adapter lately (likely still loaded)


def load_of(planner: Planner) -> int:
    return planner.num_running + planner.num_waiting


def route(
    planners: dict[str, Planner],
    token_ids: list[int],
    overload_margin: int,
    root: bytes = ROOT_KEY,
    lora: LoRAKey | None = None,
) -> RouteChoice | None:
    """None when there is no worker. `overload_margin`: extra queued requests a hit may cost.

    `root`: the root of the prompt's key chain (its cache salt): only blocks of the same salt
    count as a hit, so routing reveals nothing about another tenant's prompts either.
    `lora`: the request's adapter: only workers that serve LoRA are candidates, and among those
    within the margin, one that ran the adapter lately wins (it need not load it).
    """
    if lora is not None:
        planners = {w: p for w, p in planners.items() if p.loras.max_loras > 0}
    if not planners:
        return None
    choices = []
    for worker_id, planner in planners.items():
        cached = planner.cached_prefix_tokens(token_ids, root)
        choices.append(RouteChoice(worker_id, cached, load_of(planner), planner.loras.holds(lora)))
    least = min(c.load for c in choices)
    eligible = [c for c in choices if c.load <= least + overload_margin]
    # First maximum wins ties.
    return max(eligible, key=lambda c: (c.holds_lora, c.cached_tokens, -c.load))
