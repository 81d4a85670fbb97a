"""The diagnostic switches of the worker's KV store memory (issue 32) and the benchmark's variants."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from worker_svc.kv_diagnostics import SWITCHES, diag
from worker_svc.kv_load_staging import LoadStaging


def test_a_switch_is_on_only_when_set_to_something_but_0(monkeypatch: pytest.MonkeyPatch) -> None:
    name = "LLMESH_KV_DIAG_PAGEABLE_LOAD"
    monkeypatch.delenv(name, raising=False)
    assert not diag(name)
    monkeypatch.setenv(name, "0")
    assert not diag(name)
    monkeypatch.setenv(name, "1")
    assert diag(name)
    with pytest.raises(AssertionError):
        diag("LLMESH_KV_DIAG_TYPO")


def test_pageable_load_staging_keeps_its_slots() -> None:
    staging = LoadStaging((2, 4), torch.float32, max_bytes=3 * 32, pinned=False)
    pool = staging.take()
    assert pool.shape == (3, 2, 4) and not pool.is_pinned()
    assert staging.take() is pool  # made once


def test_the_benchmarks_variants_set_the_switches_and_put_them_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[3] / "benchmarks"))
    import kv_store

    for name in SWITCHES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LLMESH_KV_DIAG_NO_ARENA_LOCK", "0")  # a value the variant overrides, then restores
    assert set(kv_store.VARIANTS["nopin"]) == set(SWITCHES)
    with kv_store.variant("nopin") as suffix:
        assert suffix == " [nopin]" and all(diag(name) for name in SWITCHES)
    assert os.environ["LLMESH_KV_DIAG_NO_ARENA_LOCK"] == "0"
    assert not any(diag(name) for name in SWITCHES)
    with kv_store.variant("freepinned") as suffix:
        assert kv_store.FREE_PINNED and suffix == " [freepinned]"
    assert not kv_store.FREE_PINNED
    with kv_store.variant("base") as suffix:
        assert suffix == ""
