"""colora.run.heap.frozen_heap: the set-up's objects leave the collector's passes for the run and come
back after it; what the run makes is collected as usual."""

from __future__ import annotations

import gc
import weakref

from colora.run.heap import frozen_heap


class _Node:
    pass


def _cycle() -> tuple[_Node, weakref.ref]:
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return a, weakref.ref(a)


def test_garbage_at_entry_is_collected_and_new_cycles_as_usual():
    gc.disable()  # no automatic pass may free anything behind the test's back
    try:
        node, before = _cycle()
        del node  # a cycle: only the collector frees it
        with frozen_heap():
            assert before() is None  # collected before the freeze
            assert gc.get_freeze_count() > 0
            node, inside = _cycle()
            del node
            gc.collect()
            assert inside() is None  # made inside: not frozen
        assert gc.get_freeze_count() == 0
    finally:
        gc.enable()


def test_a_cycle_alive_at_entry_survives_until_exit():
    gc.disable()
    try:
        node, ref = _cycle()
        with frozen_heap():
            del node  # frozen while alive, then dropped: only an unfrozen collection frees it
            gc.collect()
            assert ref() is not None
        gc.collect()
        assert ref() is None
    finally:
        gc.enable()
