"""The next training batches, read on a background thread while the current step runs.

Reading a batch is numpy gathers from memory-mapped shards plus a copy: milliseconds on
the main thread that a GPU then waits for, every step. Here a thread reads ahead
``depth`` batches into contiguous tensors (pinned on CUDA, so the copy to the device is
really asynchronous: ``non_blocking=True`` does nothing for pageable memory). The order is
the loader's own (``TokenWindows.batch``, a pure function of the sample index), so asking
for a batch by its first sample gives exactly the batch the plain loader would; asking for
another start than the one read ahead (a resume, a test that moves the position) restarts
the thread from there. ``close`` ends the thread; nothing outlives the run.

Batches of changing size (a batch ramp) read by ``plan``: a step's key (the global samples
consumed before it) -> (this rank's first sample, its count, the next step's key); a batch
read ahead that the plan no longer gives (the ramp changed its mind) is read again.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import torch

from pretrain.data.loader import TokenWindows


class Prefetcher:
    """Batches ``start, start + stride, ...`` of ``count`` samples each, read ahead."""

    def __init__(self, data: TokenWindows, count: int, stride: int, pin: bool,
                 depth: int = 2, plan: Callable[[int], tuple[int, int, int]] | None = None):
        self.data, self.count, self.stride, self.pin, self.depth = (
            data, count, stride, pin, depth)
        # key -> (first sample, count, next key); default: the key is the first sample
        self.plan = plan or (lambda key: (key, self.count, key + self.stride))
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._next: int | None = None  # the start of the next batch the queue will yield

    def _read(self, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.data.batch(start, count)
        x, y = x.contiguous(), y.contiguous()
        return (x.pin_memory(), y.pin_memory()) if self.pin else (x, y)

    def _run(self, key: int, stop: threading.Event, out: queue.Queue) -> None:
        while not stop.is_set():
            start, count, following = self.plan(key)
            try:
                item = ((key, start, count), *self._read(start, count))
            except BaseException as e:  # handed to the consumer, raised there
                item = ((key, start, count), e, None)
            while not stop.is_set():
                try:
                    out.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            key = following

    def _restart(self, start: int) -> None:
        self.close()
        self._stop, self._queue = threading.Event(), queue.Queue(maxsize=self.depth)
        self._thread = threading.Thread(target=self._run, name="pretrain-prefetch",
                                        args=(start, self._stop, self._queue), daemon=True)
        self._thread.start()
        self._next = start

    def get(self, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch whose key (its first sample, unless ``plan`` says otherwise) is
        ``start``: (inputs, targets), contiguous."""
        want = self.plan(start)
        if self._next != start:
            self._restart(start)
        got, x, y = self._queue.get()
        if got != (start, *want[:2]):  # read ahead for a plan that has changed since
            self._restart(start)
            got, x, y = self._queue.get()
        assert got == (start, *want[:2]), (got, start, want)
        self._next = want[2]
        if isinstance(x, BaseException):
            self._next = None
            raise x
        return x, y

    def close(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread, self._next = None, None
