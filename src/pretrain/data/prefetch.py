"""The next training batches, read on a background thread while the current step runs.

Reading a batch is numpy gathers from memory-mapped shards plus a copy: milliseconds on
the main thread that a GPU then waits for, every step. Here a thread reads ahead
``depth`` batches into contiguous tensors (pinned on CUDA, so the copy to the device is
really asynchronous: ``non_blocking=True`` does nothing for pageable memory). The order is
the loader's own (``TokenWindows.batch``, a pure function of the sample index), so asking
for a batch by its first sample gives exactly the batch the plain loader would; asking for
another start than the one read ahead (a resume, a test that moves the position) restarts
the thread from there. ``close`` ends the thread; nothing outlives the run.
"""

from __future__ import annotations

import queue
import threading

import torch

from pretrain.data.loader import TokenWindows


class Prefetcher:
    """Batches ``start, start + stride, ...`` of ``count`` samples each, read ahead."""

    def __init__(self, data: TokenWindows, count: int, stride: int, pin: bool,
                 depth: int = 2):
        self.data, self.count, self.stride, self.pin, self.depth = (
            data, count, stride, pin, depth)
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._next: int | None = None  # the start of the next batch the queue will yield

    def _read(self, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.data.batch(start, self.count)
        x, y = x.contiguous(), y.contiguous()
        return (x.pin_memory(), y.pin_memory()) if self.pin else (x, y)

    def _run(self, start: int, stop: threading.Event, out: queue.Queue) -> None:
        while not stop.is_set():
            try:
                item = (start, *self._read(start))
            except BaseException as e:  # handed to the consumer, raised there
                item = (start, e, None)
            while not stop.is_set():
                try:
                    out.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            start += self.stride

    def _restart(self, start: int) -> None:
        self.close()
        self._stop, self._queue = threading.Event(), queue.Queue(maxsize=self.depth)
        self._thread = threading.Thread(target=self._run, name="pretrain-prefetch",
                                        args=(start, self._stop, self._queue), daemon=True)
        self._thread.start()
        self._next = start

    def get(self, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch whose first sample is ``start``: (inputs, targets), contiguous."""
        if self._next != start:
            self._restart(start)
        got, x, y = self._queue.get()
        assert got == start, (got, start)
        self._next = start + self.stride
        if isinstance(x, BaseException):
            self._next = None
            raise x
        return x, y

    def close(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread, self._next = None, None
