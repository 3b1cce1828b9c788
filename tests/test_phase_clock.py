"""The iteration's phase times (``flowgrpo/timing.py``): on the CPU each phase's wall time, a phase entered twice
adding up, ``take`` reading and starting afresh. (The CUDA path, events read at ``take``, needs a GPU: not run here.)"""

from __future__ import annotations

import time

from sp_diffusers.flowgrpo.timing import PhaseClock


def test_phases_add_up_and_take_starts_afresh():
    clock = PhaseClock("cpu")
    with clock("rollout"):
        time.sleep(0.02)
    with clock("update"):
        time.sleep(0.01)
    with clock("rollout"):
        time.sleep(0.02)
    out = clock.take()
    assert set(out) == {"phase_seconds/rollout", "phase_seconds/update"}
    assert 0.04 <= out["phase_seconds/rollout"] < 1.0 and 0.01 <= out["phase_seconds/update"] < 1.0
    assert clock.take() == {}


def test_a_phase_that_raises_is_still_timed():
    clock = PhaseClock("cpu")
    try:
        with clock("reward"):
            raise RuntimeError("a reward failed")
    except RuntimeError:
        pass
    assert set(clock.take()) == {"phase_seconds/reward"}
