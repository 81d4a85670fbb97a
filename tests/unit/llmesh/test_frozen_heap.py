"""`frozen_heap`: objects alive at entry are out of the cycle collector's walks, and its full
collections are held off, until the outermost span ends, also when spans nest or overlap
across threads."""

from __future__ import annotations

import gc
import threading
import weakref

from llmesh.frozen_heap import frozen_heap


def test_frozen_for_the_span_then_back() -> None:
    gc.unfreeze()
    keep = [[] for _ in range(100)]  # noqa: F841 - tracked objects alive at entry
    # The count is only compared with `keep`'s size: a frozen object that dies (another
    # thread's, the interpreter's) leaves the permanent generation, so the count may fall by a
    # few while a span is open; an unfreeze would drop it to zero.
    with frozen_heap():
        assert gc.get_freeze_count() > 100
        with frozen_heap():  # nested: still frozen, nothing moved back
            assert gc.get_freeze_count() > 100
        assert gc.get_freeze_count() > 100
    assert gc.get_freeze_count() == 0


def test_a_cycle_made_before_is_collected_after() -> None:
    class Node:
        pass

    a, b = Node(), Node()
    a.other, b.other = b, a
    gone = threading.Event()
    weakref.finalize(a, gone.set)
    with frozen_heap():
        del a, b
        gc.collect()
        assert not gone.is_set()  # frozen with the rest of the heap at entry
    gc.collect()
    assert gone.is_set()


def test_overlapping_threads_unfreeze_once_the_last_leaves() -> None:
    entered, release = threading.Barrier(2), threading.Event()

    def other() -> None:
        with frozen_heap():
            entered.wait()
            release.wait()

    t = threading.Thread(target=other)
    with frozen_heap():
        t.start()
        entered.wait()
    assert gc.get_freeze_count() > 0  # the other thread's span is still open
    release.set()
    t.join()
    assert gc.get_freeze_count() == 0


def test_full_collections_held_off_for_the_span_then_back() -> None:
    before = gc.get_threshold()
    with frozen_heap():
        t0, t1, t2 = gc.get_threshold()
        assert (t0, t1) == before[:2] and t2 > 1000 * max(before[2], 1)
        with frozen_heap():  # nested: unchanged
            assert gc.get_threshold()[2] == t2
        assert gc.get_threshold()[2] == t2
    assert gc.get_threshold() == before
