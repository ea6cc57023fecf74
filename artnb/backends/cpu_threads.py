"""How many threads torch uses on a CPU, decided in one place for the engine server and the trainer.

torch's own default counts physical cores, which on a VM is often fewer than the cores this process may run
on; artnb uses all of those. OMP_NUM_THREADS, when set, wins: e.g. two processes sharing 2 cores (the test
suite's two workers, a notebook beside a server) run faster with one thread each than with two that
preempt each other at every parallel region.
"""

from __future__ import annotations

import os


def cpu_threads() -> int:
    """OMP_NUM_THREADS when set to a positive integer, else the number of cores this process may run on."""
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    if value.isdigit() and int(value) > 0:
        return int(value)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
