"""The Step stream's choice between reading the step in flight and launching the next plan."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from tests.helpers.fake_device import FakeDeviceEvent
from worker_svc.servicer import _arrives_first, _DeviceDone


async def test_a_plan_that_arrives_while_the_device_works_is_taken_first():
    event = FakeDeviceEvent()
    pipeline = SimpleNamespace(pending_event=event)
    read, stop = asyncio.get_running_loop().create_future(), asyncio.get_running_loop().create_future()
    device = _DeviceDone()
    waiting = asyncio.ensure_future(_arrives_first(pipeline, device, read, stop))
    await asyncio.sleep(0.05)
    assert not waiting.done()  # neither the device nor a plan yet: it waits for both
    read.set_result("plan")
    assert await waiting is True
    event.fire()


async def test_a_step_that_ends_first_is_read_and_its_wait_is_not_repeated():
    event = FakeDeviceEvent()
    pipeline = SimpleNamespace(pending_event=event)
    read, stop = asyncio.get_running_loop().create_future(), asyncio.get_running_loop().create_future()
    device = _DeviceDone()
    first = device.of(event)
    event.fire()
    assert await _arrives_first(pipeline, device, read, stop) is False
    assert device.of(event) is first  # one thread-pool wait per step


async def test_without_a_device_event_it_looks_at_the_socket_once():
    pipeline = SimpleNamespace(pending_event=None)
    read, stop = asyncio.get_running_loop().create_future(), asyncio.get_running_loop().create_future()
    assert await _arrives_first(pipeline, _DeviceDone(), read, stop) is False
