"""Where an iteration's time goes, phase by phase, without a host sync on the hot path.

``clock = PhaseClock(device)``; ``with clock("rollout"): ...`` around each phase of the loop; ``clock.take()`` once
the iteration is done gives ``{"phase_seconds/rollout": s, ...}`` and starts afresh. On the CPU each phase is its
wall time (``perf_counter``). On CUDA it is the device's time between two events recorded on the current stream at
the phase's ends: nothing waits for the device until ``take``, which runs after the iteration's metrics were read
(a sync that happens anyway). A phase entered twice adds up. Phases measured on the main thread: work overlapped
by a background thread (rollout.chunks' scoring) shows as the main thread's wait, not as its own time.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["PhaseClock"]


class PhaseClock:
    def __init__(self, device: torch.device | str) -> None:
        self.cuda = torch.device(device).type == "cuda"
        self._wall: dict[str, float] = {}
        self._events: list[tuple[str, Any, Any]] = []

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                yield
            finally:
                end.record()
                self._events.append((phase, start, end))
            return
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._wall[phase] = self._wall.get(phase, 0.0) + time.perf_counter() - t0

    def take(self) -> dict[str, float]:
        """Seconds per phase since the last ``take`` (on CUDA: waits for the last phase's end event)."""
        out = dict(self._wall)
        if self._events:
            self._events[-1][2].synchronize()
            for phase, start, end in self._events:
                out[phase] = out.get(phase, 0.0) + start.elapsed_time(end) / 1000.0
        self._wall, self._events = {}, []
        return {f"phase_seconds/{k}": v for k, v in out.items()}
