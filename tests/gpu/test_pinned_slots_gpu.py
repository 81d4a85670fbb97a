"""The page-locked buffers kernels read and write: lent again only once free of the GPU and of
their holder."""

from __future__ import annotations

import torch

from kernels.triton.pinned_io import copy_to_host
from worker_svc.pinned_slots import PinnedSlots


def test_a_buffer_goes_out_again_only_after_its_last_use_and_its_holder() -> None:
    pool = PinnedSlots()
    first = pool.take(100)
    assert first.buffer.is_pinned() and first.buffer.numel() == 4096  # the smallest size
    buffer = first.buffer
    held = pool.take(100)
    assert held.buffer.data_ptr() != buffer.data_ptr()  # `first` still holds it
    # ~0.5 s of GPU work queued before the buffer's last use. (Page-locking a new buffer may
    # wait for the device, so every buffer this test needs while it runs is taken before.)
    torch.cuda._sleep(1_000_000_000)
    first.record()
    del first  # its last reference: given back at once
    busy = pool.take(100)
    assert busy.buffer.data_ptr() != buffer.data_ptr()  # given back, but its event has not fired
    torch.cuda.synchronize()
    again = pool.take(4000)
    assert again.buffer.data_ptr() == buffer.data_ptr()
    assert pool.take(5000).buffer.numel() == 8192


def test_results_stored_by_a_kernel_are_on_the_host_once_the_event_fires() -> None:
    pool = PinnedSlots()
    src = torch.arange(3000, dtype=torch.int64, device="cuda") * 7
    slot = pool.take(src.numel() * 4)
    host = slot.buffer[: src.numel() * 4].view(torch.int32)
    torch.cuda._sleep(50_000_000)
    copy_to_host(src, host)
    slot.record().synchronize()
    assert torch.equal(host, (torch.arange(3000) * 7).to(torch.int32))
