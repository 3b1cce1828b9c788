"""Test files in the order that finishes soonest on several pytest workers (scripts/test.sh: a file per
worker): the longest first, so that none of them starts last and runs alone. Within a file nothing moves."""

from __future__ import annotations

# the slowest files on a 2-core machine, slowest first (`--durations`); the rest keep pytest's order after them
SLOWEST_FIRST = (
    "test_model_parity.py",
    "test_patches.py",
    "test_verl_omni.py",
    "test_faults.py",
    "test_plan.py",
    "test_main_job.py",
    "test_verl.py",
    "test_extras.py",
    "test_hot_path.py",
    "test_plan_shortcut.py",
    "test_install.py",
    "test_exit.py",
    "test_gpu_check.py",
    "test_engine.py",
)


def pytest_collection_modifyitems(session, config, items) -> None:
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order
