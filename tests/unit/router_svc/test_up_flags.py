"""`llmesh up --schedulers N`: the router's flags and key reach run_up; N = 1 changes nothing."""

from __future__ import annotations

from llmesh.cli import build_parser, up_kwargs


def kwargs(*argv: str) -> dict:
    return up_kwargs(build_parser().parse_args(["up", *argv]))


def test_one_scheduler_is_today_s_topology():
    kw = kwargs("--api-key", "k" * 20)
    assert kw["num_schedulers"] == 1 and kw["router_args"] == []
    assert "LLMESH_ROUTER_API_KEY" not in kw["env"]


def test_several_schedulers_get_a_router_with_its_own_flags_and_the_api_key():
    kw = kwargs("--schedulers", "3", "--workers", "6", "--router.policy", "load", "--api-key", "k" * 20)
    assert kw["num_schedulers"] == 3 and kw["num_workers"] == 6
    assert kw["router_args"] == ["--policy", "load"]
    assert kw["env"]["LLMESH_ROUTER_API_KEY"] == "k" * 20
