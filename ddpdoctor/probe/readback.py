"""Device → host reads without a host synchronisation on every step.

On a GPU, `tensor.cpu()` (or `.item()`, `.tolist()`) waits until every kernel queued before it has run: a recorder
that read its per-step measurements that way would stall the script's CPU side once per step, and the probe would
no longer measure the script's own speed. Recorders compute their reductions on the device instead (a few numbers
per step) and hand them to `Readback.read`: the values are copied into pinned host memory with
`non_blocking=True` behind a CUDA event, and the callback runs once the event has completed — checked without
blocking at the next step (`poll`), forced only when more than `max_pending` steps are outstanding, and at the end
of the run (`drain`). The copy is stream-ordered on the current stream, so in-place updates the script queues later
(the optimizer's next step) cannot change what is read.

Tensors on the CPU (CPU runs, CUDA emulation) are handed to the callback at once, so a CPU run records exactly
what it did before. `defer_cpu=True` routes CPU tensors through the deferred path too: the tests use it to check,
on machines without a GPU, that deferred recording produces the same events.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, Sequence

Callback = Callable[[list[Any]], None]


class Readback:
    def __init__(self, *, max_pending: int = 4, defer_cpu: bool = False,
                 on_error: Callable[[str, BaseException], None] | None = None) -> None:
        self.max_pending = max(1, int(max_pending))
        self.defer_cpu = defer_cpu
        self.on_error = on_error
        self._pending: deque[tuple[Any, list[Any], Callback, str]] = deque()
        self.closed = False  # drained at the end of the run: later reads are delivered at once
        self.deferred = 0  # reads that went through the deferred path (for tests and the benchmark)
        self.forced = 0  # of which had to wait because too many were outstanding

    def read(self, tensors: Sequence[Any], then: Callback, *, where: str = "readback") -> None:
        """Call `then(host_tensors)` with CPU copies of `tensors` (same order), now or once they are copied."""
        import torch

        tensors = [t.detach() for t in tensors]
        on_device = [t for t in tensors if t.device.type != "cpu"]
        if self.closed:  # the end of the run: one synchronisation is fine, and nothing would deliver it later
            self._run(then, [t.cpu() for t in tensors], where)
            return
        if not on_device and not self.defer_cpu:
            self._run(then, tensors, where)
            return
        if on_device and torch.cuda.is_available() and all(t.device.type == "cuda" for t in on_device):
            host = []
            for t in tensors:
                if t.device.type == "cpu":
                    host.append(t.clone())
                    continue
                dst = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
                dst.copy_(t, non_blocking=True)
                host.append(dst)
            event = torch.cuda.Event()
            event.record()
        elif on_device:  # another accelerator: read it plainly (one synchronisation)
            self._run(then, [t.cpu() for t in tensors], where)
            return
        else:  # defer_cpu: CPU tensors through the deferred path (copies, as a GPU read would produce)
            host, event = [t.clone() for t in tensors], None
        self.deferred += 1
        self._pending.append((event, host, then, where))
        self.poll()

    def poll(self) -> None:
        """Run the callbacks whose copies have landed, in order; wait only while too many are outstanding."""
        while self._pending:
            event = self._pending[0][0]
            too_many = len(self._pending) > self.max_pending
            if event is None:  # a deferred CPU read (tests): it lands at the next step, or when too many wait
                if not too_many:
                    return
            elif not event.query():
                if not too_many:
                    return
                event.synchronize()
                self.forced += 1
            _, host, then, where = self._pending.popleft()
            self._run(then, host, where)

    def step(self) -> None:
        """Once per optimizer step: deliver what has landed (deferred CPU reads count as landed here)."""
        if self.defer_cpu:
            while self._pending and self._pending[0][0] is None:
                _, host, then, where = self._pending.popleft()
                self._run(then, host, where)
        self.poll()

    def drain(self) -> None:
        """End of the run: wait for every outstanding copy and run its callback; later reads run at once."""
        self.closed = True
        while self._pending:
            event, host, then, where = self._pending.popleft()
            if event is not None:
                event.synchronize()
            self._run(then, host, where)

    @property
    def pending(self) -> int:
        return len(self._pending)

    def _run(self, then: Callback, host: list[Any], where: str) -> None:
        try:
            then(host)
        except Exception as exc:  # a recorder's failure never reaches the user's script
            if self.on_error is None:
                raise
            self.on_error(where, exc)


DEFER_ENV = "DDPDOCTOR_READBACK_DEFER"  # "1": defer CPU reads too (tests of the GPU path on CPU machines)


def for_probe(probe: Any) -> Readback:
    """The probe's one Readback: delivered at every optimizer step (before the other step hooks, so a step's
    deferred events come before the next ones) and drained first thing at the end of the run. Call it when a
    recorder is installed, never from a step hook (it adds hooks)."""
    import os

    rb = getattr(probe, "_readback", None)
    if rb is None:
        rb = Readback(defer_cpu=os.environ.get(DEFER_ENV) == "1", on_error=probe.internal_error)
        probe._readback = rb
        probe.step_hooks.insert(0, lambda _optimizer: rb.step())
        probe.end_hooks.insert(0, rb.drain)
    return rb
