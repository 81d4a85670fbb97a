"""`llmesh up --prefill-workers P --decode-workers D`: P workers with --role prefill, D with --role decode."""

from __future__ import annotations

import pytest

from llmesh import cli


def up(*argv: str) -> dict:
    return cli.up_kwargs(cli.build_parser().parse_args(["up", *argv]))


def test_prefill_and_decode_workers_get_their_roles():
    kw = up("--prefill-workers", "1", "--decode-workers", "2")
    assert kw["num_workers"] == 3 and kw["worker_roles"] == ["prefill", "decode", "decode"]
    plain = up("--workers", "2")
    assert plain["num_workers"] == 2 and plain["worker_roles"] is None


def test_prefill_workers_alone_are_refused():
    with pytest.raises(SystemExit, match="needs --decode-workers"):
        up("--prefill-workers", "2")


def test_worker_gpus_give_each_worker_its_gpu():
    kw = up("--prefill-workers", "1", "--decode-workers", "2", "--worker-gpus", "0,1")
    assert kw["per_worker_env"] == [{"CUDA_VISIBLE_DEVICES": g} for g in ("0", "1", "0")]
    assert up("--workers", "2")["per_worker_env"] is None
    with pytest.raises(SystemExit, match="GPU indices"):
        up("--worker-gpus", "cuda:0")
