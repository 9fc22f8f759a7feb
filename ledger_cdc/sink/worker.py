"""The sink on a thread of its own: group commit without blocking the stream."""

from __future__ import annotations

import contextlib
import os
import threading
import time

from ledger_cdc.batching import Batch
from ledger_cdc.sink.base import Sink

__all__ = ["SinkWorker"]


class SinkWorker:
    """Commits batches on a thread of its own (group commit): while one batch is being written,
    the stream loop goes on reading and folding the next (reading only, when the sink also
    publishes: see ``Consumer._stream_loop``), so batches grow with the sink's latency under
    load and stay single transactions when idle. One batch at a time, in order; the loop hands
    each over frozen (:meth:`Batch.freeze`)."""

    def __init__(self, sink: Sink) -> None:
        self.sink = sink
        self._batch: Batch | None = None
        self._error: BaseException | None = None
        self._finished: Batch | None = None
        self._cond = threading.Condition()
        self._rfd, self._wfd = os.pipe()
        os.set_blocking(self._rfd, False)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="ledger-cdc-sink", daemon=True)
        self._thread.start()

    @property
    def wakeup_fd(self) -> int:
        return self._rfd

    @property
    def busy(self) -> bool:
        return self._batch is not None

    @property
    def done(self) -> bool:
        return self._finished is not None or self._error is not None

    def submit(self, batch: Batch) -> None:
        with self._cond:
            assert self._batch is None
            self._batch = batch
            self._cond.notify_all()

    def wait(self) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._batch is None)

    def take(self) -> Batch | None:
        """The batch committed since the last call (re-raising the sink's error, if any)."""
        if self._finished is None and self._error is None:
            return None  # nothing settled: no byte in the pipe either (written with it, below)
        with self._cond:
            with contextlib.suppress(BlockingIOError):
                os.read(self._rfd, 512)
            if self._error is not None:
                err, self._error = self._error, None
                raise err
            done, self._finished = self._finished, None
            return done

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._batch is not None or self._closed)
                if self._closed:
                    return
                batch = self._batch
            assert batch is not None
            try:
                self.sink.commit(batch)
                batch.committed_at = time.time()
                error = None
            except BaseException as e:  # handed to the stream loop
                error = e
            with self._cond:
                # the wake-up byte first, under the lock: whoever sees the batch settled finds
                # the byte there to read, so none is left behind to wake the loop for nothing
                with contextlib.suppress(OSError):
                    os.write(self._wfd, b"x")
                if error is None:
                    self._finished = batch
                else:
                    self._error = error
                self._batch = None
                self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(60)
        for fd in (self._rfd, self._wfd):
            with contextlib.suppress(OSError):
                os.close(fd)
