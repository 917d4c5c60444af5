"""prefix_service/heap.py: after start-up the collector no longer walks the objects start-up made.
Run in a child process: freezing the test process's heap would keep its later cycles forever."""
from __future__ import annotations

import subprocess
import sys
import textwrap

CHILD = textwrap.dedent("""
    import gc, weakref
    from prefix_service.heap import freeze_startup_objects, pauses

    class Node:
        pass

    kept = [Node() for _ in range(5000)]            # what start-up keeps
    cycle = Node(); cycle.self = cycle              # start-up garbage that only the collector frees
    dropped = weakref.ref(cycle)
    del cycle
    timings = pauses()
    gc.collect()
    assert timings.longest[2] > 0 and timings.count[2] == 1
    gc.disable()                                    # no collection but the one under test
    frozen = freeze_startup_objects()
    assert timings.longest == [0.0, 0.0, 0.0] and timings.count[2] == 2  # start-up's walks not in the maximum
    assert dropped() is None, "the garbage was frozen instead of collected"
    assert frozen >= len(kept) and gc.get_freeze_count() >= len(kept), frozen
    walked = {id(o) for g in range(3) for o in gc.get_objects(generation=g)}
    assert not any(id(n) in walked for n in kept), "a start-up object is still in a collected generation"
    later = Node(); later.self = later              # made after start-up: collected as before
    after = weakref.ref(later)
    del later
    assert gc.collect() >= 1 and after() is None
    assert timings.count[2] == 3 and 0 < timings.longest[2] <= timings.seconds[2]
    print("OK", frozen)
""")


def test_freeze_collects_start_up_garbage_and_keeps_live_objects_out_of_later_collections():
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("OK "), proc.stdout
