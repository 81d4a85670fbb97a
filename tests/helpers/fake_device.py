"""A stand-in for a CUDA event, for tests of code that waits on a step's device work."""

from __future__ import annotations

import threading


class FakeDeviceEvent:
    """A step's end on a device that the test decides: `synchronize` blocks until `fire`."""

    def __init__(self) -> None:
        self._fired = threading.Event()

    def synchronize(self) -> None:
        assert self._fired.wait(10), "the test never fired this step's event"

    def fire(self) -> None:
        self._fired.set()
