"""Rank 0's side of a tensor-parallel worker: it starts the other ranks, feeds them each step's
inputs, and watches them.

One process per rank (`python -m worker_svc.rank_worker`), so every rank has a device, a
CUDA context and a Python interpreter of its own (one process driving N devices would launch
N models' kernels from one GIL). Rank 0 is the process that built the `ModelRunner` (the
worker service, or the offline engine's process): it keeps the Step stream, the sequences'
state and the sampler; the others only run the forward on their shard (`rank_channel`).

Failure is loud, never a hang:
* a rank that dies is seen within `POLL_S` by a watcher thread: the group is aborted (a
  collective waiting on it fails), every later step raises, and `on_failure` is called (the
  worker service exits, so that its supervisor and the scheduler see a dead worker);
* every collective carries the group's timeout (`tp_timeout_s`) as a backstop;
* the other ranks leave when rank 0 does: their step pipe reaches EOF, and a thread of theirs
  also watches rank 0's pid (for a rank blocked inside a collective when rank 0 died).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import logging
import os
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist

from worker_svc.config import WorkerConfig
from worker_svc.models.config import ModelConfig
from worker_svc.parallel import TensorParallel, backend_for, check_shardable, open_group
from worker_svc.rank_channel import STOP, ForwardInputs, encode

if TYPE_CHECKING:
    from worker_svc.executor import Patch

log = logging.getLogger(__name__)

POLL_S = 0.2  # how often the watcher looks at the other ranks' processes


def joined_key(rank: int) -> str:
    return f"llmesh-tp-joined/{rank}"


def rank_config(config: WorkerConfig, rank: int) -> WorkerConfig:
    """The config rank `rank` runs with: its own device (cuda:i -> cuda:i+rank)."""
    device = config.torch_device()
    if device.type != "cuda":
        return dataclasses.replace(config, device=str(device))
    base = device.index if device.index is not None else 0
    return dataclasses.replace(config, device=f"cuda:{base + rank}")


def start_rank_group(
    config: WorkerConfig, model_path: str, on_failure: Callable[[str], None] | None = None
) -> RankGroup | None:
    """The other ranks of a worker with tensor_parallel_size > 1, started; None at size 1.

    A size the model cannot be split by is refused here, before any process starts.
    """
    size = config.tensor_parallel_size
    if size == 1:
        return None
    check_shardable(ModelConfig.from_pretrained(model_path), size)
    # The resolved folder: the other ranks find the same files without converting anything again.
    return RankGroup(dataclasses.replace(config, model=model_path), on_failure)


class RankGroup:
    def __init__(
        self,
        config: WorkerConfig,
        on_failure: Callable[[str], None] | None = None,
        startup_timeout_s: float = 120.0,
    ) -> None:
        self.size = config.tensor_parallel_size
        self.device = config.torch_device()
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", 0)  # rank r runs on cuda:r (rank_config), so rank 0 on cuda:0
        self.on_failure = on_failure
        self.failure: str | None = None
        self._closing = False
        if self.device.type == "cuda" and torch.cuda.device_count() < self.size + (self.device.index or 0):
            raise ValueError(
                f"tensor_parallel_size {self.size} needs {self.size} CUDA devices from {self.device}; "
                f"{torch.cuda.device_count()} visible"
            )
        timeout = datetime.timedelta(seconds=config.tp_timeout_s)
        # Port 0: the OS picks a free loopback port; the other ranks get it on their command line.
        store = dist.TCPStore(
            "127.0.0.1", 0, self.size, is_master=True, timeout=timeout, wait_for_workers=False
        )
        self.procs: list[subprocess.Popen] = []
        try:
            for rank in range(1, self.size):
                self.procs.append(self._spawn(config, rank, store.port))
            self._wait_joined(store, startup_timeout_s)
            self.tp: TensorParallel = open_group(
                0,
                self.size,
                store.port,
                backend_for(self.device),
                config.tp_timeout_s,
                self.device,
                store,
                all_reduce=config.tp_all_reduce,
            )
        except BaseException:
            self._kill()
            raise
        # The watcher holds the group weakly, and a finalizer ends the ranks: a runner that is
        # dropped without close() (an LLM going out of scope) takes its ranks with it.
        ref = weakref.ref(self)
        threading.Thread(target=_watch, args=(ref,), name="llmesh-tp-watch", daemon=True).start()
        weakref.finalize(self, _end_processes, self.procs)

    # ----- start -----
    def _spawn(self, config: WorkerConfig, rank: int, port: int) -> subprocess.Popen:
        # Only the runner's settings (a service's config adds ports, tokens...), as JSON.
        own = rank_config(config, rank)
        cfg = json.dumps({f.name: getattr(own, f.name) for f in dataclasses.fields(WorkerConfig)})
        cmd = [
            sys.executable, "-m", "worker_svc.rank_worker",
            "--rank", str(rank), "--size", str(self.size), "--store-port", str(port),
            "--parent-pid", str(os.getpid()), "--config", cfg,
        ]  # fmt: skip
        # stdin is the step channel; stdout/stderr are the worker's own (its logs show theirs).
        return subprocess.Popen(cmd, stdin=subprocess.PIPE, bufsize=0)

    def _wait_joined(self, store: dist.TCPStore, timeout_s: float) -> None:
        """Until every rank has reached the store; a rank that exits first fails the start at once."""
        keys = [joined_key(r) for r in range(1, self.size)]
        deadline = time.monotonic() + timeout_s
        while not store.check(keys):
            for rank, proc in enumerate(self.procs, start=1):
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"tensor-parallel rank {rank} exited with code {proc.returncode} at start"
                    )
            if time.monotonic() > deadline:
                raise TimeoutError(f"tensor-parallel ranks did not start within {timeout_s:.0f} s")
            time.sleep(0.05)

    # ----- per step -----
    def check_alive(self) -> None:
        if self.failure is not None:
            raise RuntimeError(f"tensor-parallel worker is broken: {self.failure}")

    def send(self, inputs: ForwardInputs, patch: Patch | None) -> None:
        """Give every rank this step's inputs, then the in-flight token ids `patch` refers to."""
        self._write(inputs.encode())
        if patch is not None:
            self.tp.broadcast_from_first(patch.gathered())

    def announce(self, kind: int, arrays: list[np.ndarray]) -> None:
        """Tell every rank what rank 0 does next besides a step (a KV gather or scatter)."""
        self._write(encode(kind, arrays))

    def _write(self, message: bytes) -> None:
        self.check_alive()
        for rank, proc in enumerate(self.procs, start=1):
            try:
                proc.stdin.write(message)  # type: ignore[union-attr]
            except (BrokenPipeError, OSError) as e:
                self._fail(f"rank {rank} is gone ({e})")
                self.check_alive()

    # ----- failure -----
    def _fail(self, why: str) -> None:
        if self.failure is not None:
            return
        self.failure = why
        log.error("tensor-parallel %s: this worker cannot step any more", why)
        self.tp.abort()  # a collective waiting on the dead rank fails (else the group's timeout does)
        self._kill()
        if self.on_failure is not None:
            self.on_failure(why)

    # ----- stop -----
    def close(self, timeout_s: float = 10.0) -> None:
        """Ask every rank to stop, then make sure it has (kill after `timeout_s`)."""
        if self._closing:
            return
        self._closing = True
        stop = encode(STOP, [])
        for proc in self.procs:
            with contextlib.suppress(OSError):
                proc.stdin.write(stop)  # type: ignore[union-attr]
        # Now, while the other ranks tear the group down too: NCCL's teardown waits for all of them.
        self.tp.close(timeout_s)
        _end_processes(self.procs, timeout_s)

    def _kill(self) -> None:
        self._closing = True
        _end_processes(self.procs, grace_s=0.0)


def _watch(ref: weakref.ref[RankGroup]) -> None:
    """Until the group closes or is dropped: report the first rank that exits."""
    while True:
        group = ref()
        if group is None or group._closing:
            return
        for rank, proc in enumerate(group.procs, start=1):
            code = proc.poll()
            if code is not None and not group._closing:
                group._fail(f"rank {rank} exited with code {code}")
                return
        del group
        time.sleep(POLL_S)


def _end_processes(procs: list[subprocess.Popen], grace_s: float = 5.0) -> None:
    """Close each rank's step pipe (it leaves at EOF), then kill what is still running after `grace_s`."""
    for proc in procs:
        with contextlib.suppress(OSError):
            proc.stdin.close()  # type: ignore[union-attr]
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
