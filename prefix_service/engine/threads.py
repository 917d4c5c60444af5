"""The engine's threads below the rest of the process (model.thread_nice).

On a CPU a step keeps every core busy. The threads that forward its output (the asyncio loop,
gRPC's and the HTTP server's) are light and latency-bound; the engine's loop thread, its OpenMP
workers and the threads that prepare requests (tokenizing, compiling grammars: the servers'
executor) are compute. The compute threads run at the process's nice value + model.thread_nice, so
the forwarding threads preempt a step at once, while compute shares the cores evenly among itself.
Linux keeps a nice value per thread, and a thread inherits its creator's: the loop thread lowers
itself before its first torch work, so the OpenMP workers it starts are lowered with it.
"""
from __future__ import annotations

import concurrent.futures
import logging
import os
import sys
import threading

import torch

from prefix_service.config import ModelConfig

log = logging.getLogger("prefix_service.engine")

CPU_THREAD_NICE = 10  # model.thread_nice's default on a CPU


def thread_nice(model: ModelConfig) -> int:
    """How far the engine's compute threads sit below the process: model.thread_nice, or by default
    CPU_THREAD_NICE on a CPU and 0 on a GPU (whose loop thread only launches kernels: made to wait,
    it would leave the device idle)."""
    if model.thread_nice is not None:
        return model.thread_nice
    device = model.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return CPU_THREAD_NICE if device == "cpu" else 0


def lower_thread_priority(nice: int) -> int | None:
    """Put the calling thread at the process's nice value (its main thread's) + nice, unless it is
    there or lower already (a thread started by a lowered one); threads it starts later inherit it.
    Returns the thread's nice value, or None where nothing was set: nice 0, or not Linux (elsewhere
    a nice value belongs to the whole process, and a thread id is no process id), or refused."""
    if nice <= 0 or not sys.platform.startswith("linux"):
        return None
    tid = threading.get_native_id()
    try:
        target = min(os.getpriority(os.PRIO_PROCESS, os.getpid()) + nice, 19)
        if os.getpriority(os.PRIO_PROCESS, tid) < target:
            os.setpriority(os.PRIO_PROCESS, tid, target)
        return os.getpriority(os.PRIO_PROCESS, tid)
    except OSError as e:
        log.warning("model.thread_nice: could not lower a compute thread's priority: %s", e)
        return None


def compute_executor(max_workers: int, nice: int, thread_name_prefix: str) -> concurrent.futures.ThreadPoolExecutor:
    """A thread pool whose threads run at the engine's priority (nice as for lower_thread_priority):
    for the work that prepares requests, which should share the cores with the engine's steps rather
    than preempt them."""
    return concurrent.futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=thread_name_prefix,
                                                 initializer=lower_thread_priority, initargs=(nice,))
