"""Every patch on every diffusers version of the matrix (4 gloo ranks): the probe agrees with the measured
reference table, the defect shows without the patch exactly where the probe says so, it is gone with
the patch, apply/revert are idempotent, and uninstall() leaves diffusers as it was."""

from __future__ import annotations

import functools

import pytest

from ._dist import run_distributed
from ._matrix import MATRIX_VERSIONS, minor, sys_path_for

pytestmark = pytest.mark.matrix

# docs/compatibility.md, "Patches, and where install() applies them", on a CPU-only host.
AFFECTED = {
    "cpu_device_count": lambda m: m >= (0, 42),
    "root_hook_return_dict": lambda m: True,
    "mesh_injection": lambda m: m <= (0, 37),
    "qwenimage_joint_mask": lambda m: (0, 37) <= m <= (0, 38),
    "backend_leak": lambda m: m >= (0, 37),
    "native_ulysses": lambda m: True,
    "uneven_sharding": lambda m: True,
    "plan_optional_inputs": lambda m: True,
    "per_token_timestep": lambda m: True,
    "wan_text_split": lambda m: m <= (0, 36),
    "ltx2_plan": lambda m: m >= (0, 37),  # the classes arrived in 0.37
    "helios_plan": lambda m: m >= (0, 37),
}


@functools.cache
def _run(version: str) -> dict:
    return run_distributed("tests.workers.patch_checks:patch_checks", 4, sys_path=sys_path_for(version))[0]


@pytest.mark.parametrize("patch", sorted(AFFECTED))
@pytest.mark.parametrize("version", MATRIX_VERSIONS)
def test_probe_defect_and_fix(version, patch):
    r = _run(version)
    assert r["diffusers"] == version
    needed = r["probe"][patch]
    assert needed == AFFECTED[patch](minor(version)), f"{patch} probe on {version}: {r['report']}"
    check = r["checks"][patch]
    assert (check["defect"] is not None) == needed, (
        f"{patch} on {version}: probe={needed}, observed={check['defect']}"
    )
    assert check["fixed"], f"{patch} on {version} not fixed: {check}"


@pytest.mark.parametrize("version", MATRIX_VERSIONS)
def test_apply_revert_idempotent_and_uninstall(version):
    r = _run(version)
    assert r["idempotent"] and all(r["idempotent"].values()), r["idempotent"]
    assert r["after_uninstall_applied"] == []
    assert r["backend_after_uninstall"] is False
    assert r["reinstall_same"]
