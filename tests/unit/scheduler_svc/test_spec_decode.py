"""The scheduler's speculative-decoding policy: draft bounds, the adaptive back-off, the counters."""

from __future__ import annotations

from scheduler_svc.request import Request
from scheduler_svc.spec_decode import EMPTY_LOOKUP_SKIP, MAX_BACKOFF_STEPS, SpecDecodePolicy
from services.sampling_params import SamplingParams


def request(max_tokens: int | None = 100, **params) -> Request:
    return Request("r", [1, 2, 3, 4], SamplingParams(max_tokens=max_tokens, **params))


def test_drafts_never_reach_past_max_tokens_or_the_context() -> None:
    policy = SpecDecodePolicy(4)
    req = request(max_tokens=10)
    req.output_token_ids = [5] * 6
    req.num_pending = 1  # the token this plan samples: the 7th of 10
    assert policy.drafts_to_propose(req, max_model_len=1000) == 2  # 2 drafts + the token after them
    assert policy.drafts_to_propose(req, max_model_len=13) == 1  # 4 + 6 + 1 tokens, room for 2 more
    req.num_drafts, req.draft_base = 4, req.num_tokens  # proposed after its last known token
    req.num_pending = 0
    assert policy.drafts_to_verify(req, budget=100, max_model_len=1000) == 3
    assert policy.drafts_to_verify(req, budget=2, max_model_len=1000) == 1  # the budget counts them
    req.num_pending = 1  # a token sampled since: the first draft was for its position
    assert policy.drafts_to_verify(req, budget=100, max_model_len=1000) == 2
    assert SpecDecodePolicy(0).drafts_to_propose(req, 1000) == 0
    assert policy.drafts_to_propose(request(logprobs=1), 1000) == 0  # logprobs: every position sampled


def test_no_drafts_in_a_batch_bigger_than_disable_by_batch_size() -> None:
    policy = SpecDecodePolicy(4, disable_by_batch_size=4)
    assert policy.drafts_to_propose(request(), 1000, num_running=4) == 4
    assert policy.drafts_to_propose(request(), 1000, num_running=5) == 0
    assert SpecDecodePolicy(4).drafts_to_propose(request(), 1000, num_running=500) == 4  # 0: never


def test_failures_back_off_exponentially_and_success_resets() -> None:
    policy = SpecDecodePolicy(3)
    req = request()
    skips = []
    for _ in range(9):
        policy.verified(req, 3, 0)
        skips.append(req.spec_skip)
    assert skips == [1, 4, 16, 64, 128, 128, 128, 128, 128] and MAX_BACKOFF_STEPS == 128
    assert [policy.drafts_to_propose(req, 1000) for _ in range(129)].count(0) == 128
    policy.verified(req, 3, 2)
    assert req.spec_failures == 0
    policy.proposed(req, 0)  # nothing found to propose: it waited in vain, a failure too
    assert req.spec_skip == 1
    ahead = SpecDecodePolicy(3, drafts_ahead=True)
    req = request()
    for _ in range(5):  # nobody waited, only the worker's lookup found nothing: look again soon
        ahead.proposed(req, 0)
        assert req.spec_skip == EMPTY_LOOKUP_SKIP and req.spec_failures == 0
    ahead.verified(req, 3, 0)  # a verification that gains nothing still backs off
    assert req.spec_skip == 1 and req.spec_failures == 1


def test_counters_follow_vllm() -> None:
    policy = SpecDecodePolicy(3)
    req = request()
    policy.verified(req, 3, 3)
    policy.verified(req, 3, 1)
    policy.verified(req, 2, 0)
    s = policy.stats
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (3, 8, 4)
    assert s.accepted_per_pos == [2, 1, 1]
    assert s.acceptance_rate == 0.5 and abs(s.mean_acceptance_length - (1 + 4 / 3)) < 1e-9
