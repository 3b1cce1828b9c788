"""Test files in the order that finishes soonest on several pytest workers (scripts/test.sh: a file per
worker): the longest first, so that none of them starts last and runs alone. Within a file nothing moves."""

from __future__ import annotations

# the slowest files on a 2-core machine, slowest first (`--durations`); the rest keep pytest's order after them
SLOWEST_FIRST = (  # a clean-clone run's seconds per file, 2 workers
    "test_examples_image_cond.py",  # ~180 (five torchrun recipes)
    "test_model_parity.py",  # 146
    "test_verl_omni.py",  # 131
    "test_faults.py",  # 101
    "test_patches.py",  # 95
    "test_main_job.py",  # 86
    "test_exit.py",  # 79
    "test_verl.py",  # 71
    "test_trainer_io_cond.py",  # ~75 (one run, 2 cores)
    "test_plan_shortcut.py",  # 61
    "test_plan.py",  # 55
    "test_pipeline_io_cond.py",  # ~50
    "test_engine.py",  # 54
    "test_benchmarks.py",  # 48
    "test_hot_path.py",  # 43
    "test_trainer_io.py",  # 41
    "test_plan_cond.py",  # ~40
    "test_extras.py",  # 35
    "test_cli.py",  # 30
    "test_gpu_check.py",  # 27
    "test_install.py",  # 25
)


def pytest_collection_modifyitems(session, config, items) -> None:
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order
