"""verl-omni users: ``import verl`` plus ``actor_rollout_ref.model.attn_backend=ulysses_sdpa`` gives exact
Ulysses SP in verl-omni's own engine on every diffusers of the matrix.

verl-omni is not on PyPI, so these tests run a stand-in (``tests/workers/verl_omni_fake.py``, written into a
temp dir): verl-omni's module paths, its engine's call sequence and the four defects sp-diffusers patches.
Everything else is real: verl 0.9.1 (its hydra yaml, ``EngineRegistry``, FSDP2 helpers, the ``verl.plugins``
entry point), diffusers from the matrix (verl imports with every one of them), gloo ranks under
``VERL_PLATFORM=cpu``. Per version, one group of 4 ranks runs dp 1 (SP 4) and dp 2 (SP 2), each with
``ulysses_sdpa`` and ``native``: every gradient against the same step in one process within
``1e-5 + 1e-4 |ref|`` (``tests/_parity.py``); it also takes each verl-omni patch off and shows its defect.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
import tempfile
from pathlib import Path

import pytest

from ._dist import run_distributed
from ._matrix import MATRIX_VERSIONS, minor, sys_path_for
from ._parity import worst_grad
from .workers import verl_omni_fake

needs_verl = pytest.mark.skipif(importlib.util.find_spec("verl") is None, reason="verl: scripts/setup.sh")
WORLD = 4
LAYOUTS = {"dp1": 4, "dp2": 2}  # SP degree on 4 ranks (dp = 4 / SP); tests/workers/verl_omni_steps.py
VERL_OMNI_PATCHES = (
    "verl_omni_attn_backend",
    "verl_omni_cpu_engine",
    "verl_omni_min_diffusers",
    "verl_omni_qwen_mask",
)
# where each applies (docs/compatibility.md): the first two on every version
EXPECTED = {
    "verl_omni_attn_backend": lambda m: True,
    "verl_omni_cpu_engine": lambda m: True,
    "verl_omni_min_diffusers": lambda m: m <= (0, 37),
    "verl_omni_qwen_mask": lambda m: m >= (0, 38),
}
_tmp = tempfile.TemporaryDirectory(prefix="sp-verl-omni-")  # one stand-in for the session


@functools.cache
def _fake_root() -> str:
    return str(verl_omni_fake.write(Path(_tmp.name) / "pkg"))


@functools.cache
def _run(version: str) -> list[dict]:
    work = tempfile.mkdtemp(dir=_tmp.name)
    return run_distributed(
        "tests.workers.verl_omni_steps:engine_parity",
        WORLD,
        work,
        sys_path=[*sys_path_for(version), _fake_root()],
        env={"VERL_PLATFORM": "cpu", "VERL_USE_EXTERNAL_PLUGINS": "auto", "VERL_LOGGING_LEVEL": "ERROR"},
    )


@needs_verl
@pytest.mark.matrix
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("version", MATRIX_VERSIONS)
def test_verl_omni_engine_matches_one_process(version, layout):
    results = _run(version)
    sp = LAYOUTS[layout]
    r0 = results[0]
    assert r0["diffusers"] == version
    ref = r0["ref"]["grads"]
    assert len(ref) > 50
    for r in results:
        assert r["backend_registered_by_import_verl"], "import verl did not register ulysses_sdpa"
    for backend in ("ulysses_sdpa", "native"):
        step = r0[f"{layout}/{backend}"]
        assert step["ulysses_degree"] == sp and step["dp"] == WORLD // sp
        assert step["processor_backends"] == [backend], step["processor_backends"]
        assert set(ref) <= set(step["grads"]), f"{backend}: parameters without a gradient"
        # a parameter outside the loss's graph has none in one process and a zero one from FSDP's reduce-scatter
        assert all(not g.any() for n, g in step["grads"].items() if n not in ref)
        for name, g_ref in ref.items():
            ok, err = worst_grad(step["grads"][name], g_ref)
            assert ok, f"diffusers {version} {layout} {backend}: grad {name} off by {err:.3e}"
        # SP peers (adjacent ranks) computed the same micro-batch losses (x sp, as verl-omni reports them)
        for rank, r in enumerate(results):
            peer = results[rank - rank % sp][f"{layout}/{backend}"]["losses"]
            assert r[f"{layout}/{backend}"]["losses"] == pytest.approx(peer, rel=1e-6)


@needs_verl
@pytest.mark.matrix
@pytest.mark.parametrize("version", MATRIX_VERSIONS)
def test_verl_omni_patches_probe_defect_and_fix(version):
    r0 = _run(version)[0]
    m = minor(version)
    for name in VERL_OMNI_PATCHES:
        assert (name in r0["applied"]) == EXPECTED[name](m), f"{name} on {version}: {r0['report']}"
    assert ("mesh_injection" in r0["applied"]) == (m <= (0, 37))
    c = r0["controls"]
    assert "Invalid attn_backend: ulysses_sdpa" in c["verl_omni_attn_backend"]["without"]
    assert c["verl_omni_attn_backend"]["with"] == "ulysses_sdpa"  # the config keeps the value it was given
    assert "Invalid attn_backend: not_a_backend" in c["bogus_backend"]  # the check itself stays
    assert "No engine registered for device='cpu'" in c["verl_omni_cpu_engine"]["without"]
    assert c["verl_omni_cpu_engine"]["with"] == "PPODiffusersFSDPEngine"
    assert c["dpo_lookup"] == "DPODiffusersFSDPEngine"  # every verl-omni model type, not one
    if m <= (0, 37):
        assert "requires diffusers >= 0.38.0" in c["verl_omni_min_diffusers"]["without"]
        assert "needs 'ring' and 'ulysses' (missing: ['ring', 'ulysses'])" in c["mesh_without_ring"]
    else:
        assert "verl_omni_min_diffusers" not in c and "mesh_without_ring" not in c
    if m >= (0, 38):
        q = c["verl_omni_qwen_mask"]
        assert q["verl_omni_forward_on"] and not q["verl_omni_forward_after"]
        if m >= (0, 39):
            assert "does not accept an external attention_mask" in q["error"]
        else:  # 0.38: verl-omni's reorder and qwenimage_joint_mask's: silently wrong
            assert q["error"] is None and q["max_grad_err"] > 1e-3, q
    else:
        assert "verl_omni_qwen_mask" not in c


# ----------------------------------------------------------------------- verl-omni after its PR #497

_PROBES = """
import importlib, json, sys
import sp_diffusers
out = {}
for label, root in (("a1139ba", sys.argv[1]), ("after_497", sys.argv[2])):
    sys.path.insert(0, root)
    importlib.invalidate_caches()
    report = sp_diffusers.install()
    out[label] = {p.name: [p.applied, p.reason] for p in report.patches if p.name.startswith("verl_omni_")}
    if label == "after_497":  # its models package imports no mask patch, and the model's forward stays diffusers'
        import verl_omni.models  # noqa: F401
        from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformer2DModel as M
        out["forward_is_diffusers"] = M.forward.__module__ == M.__module__
        out["mask_module_imported"] = "verl_omni.models.diffusers.qwen_image" in sys.modules
    sp_diffusers.uninstall()
    sys.path.remove(root)
print(json.dumps(out))
"""


def test_patches_stay_idle_where_verl_omni_fixed_the_defect(tmp_path):
    """verl-omni's PR #497 deleted its Qwen-Image mask patch and raised its floor to diffusers 0.40: there
    ``verl_omni_qwen_mask`` and ``verl_omni_min_diffusers`` must find nothing to do (their probes read
    verl-omni's installed source and diffusers), while on a1139ba the mask patch is gated as before."""
    import json
    import subprocess

    roots = [str(verl_omni_fake.write(tmp_path / "a1139ba")), str(tmp_path / "after_497")]
    verl_omni_fake.write(roots[1], verl_omni_fake.AFTER_PR_497)
    procs = {
        version: subprocess.Popen(
            [sys.executable, "-c", _PROBES, *roots],
            env={**__import__("os").environ, "PYTHONPATH": ":".join(sys_path_for(version))},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for version in ("0.40.0", "0.42.1")  # verl-omni's floor after #497, and the newest
    }
    for version, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"{version}: {stderr[-3000:]}"
        r = json.loads(stdout.splitlines()[-1])
        before, after = r["a1139ba"], r["after_497"]
        assert before["verl_omni_qwen_mask"][0], before  # a1139ba: gated (0.39+ refuse its external mask)
        assert not after["verl_omni_qwen_mask"][0]
        assert "has no apply_qwen_image_ulysses_mask_fix" in after["verl_omni_qwen_mask"][1]
        for label in ("a1139ba", "after_497"):  # diffusers >= 0.38 takes mesh=: verl-omni's floor holds
            assert not r[label]["verl_omni_min_diffusers"][0]
            assert "mesh=" in r[label]["verl_omni_min_diffusers"][1]
        # the two defects still in the stand-in are still fixed (each probe reads the source it patches)
        assert after["verl_omni_attn_backend"][0] and after["verl_omni_cpu_engine"][0]
        assert r["forward_is_diffusers"] and not r["mask_module_imported"]


# ------------------------------------------------------------------------------------- the import hook


def test_fixes_run_when_the_module_is_imported_now_or_later(tmp_path, monkeypatch):
    """``when_imported``: at once for an imported module, right after the import for a later one, and at the
    next import for a module caught mid-import (the plugin runs inside verl-omni's own import)."""
    from sp_diffusers.patching.patches import _verl_omni

    pkg = tmp_path / "spd_hook_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "early.py").write_text("VALUE = 1\n")
    (pkg / "late.py").write_text("VALUE = 2\n")
    # registers its own fix while its code runs, as the plugin does when verl is imported from verl-omni
    (pkg / "mid.py").write_text(
        "from sp_diffusers.patching.patches import _verl_omni\n"
        "import tests.test_verl_omni as t\n"
        "_verl_omni.when_imported(__name__, t._SEEN.append)\n"
        "VALUE = 3\n"
    )
    (pkg / "after.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    _SEEN.clear()
    try:
        import spd_hook_pkg.early

        _verl_omni.when_imported("spd_hook_pkg.early", _SEEN.append)
        assert [m.VALUE for m in _SEEN] == [1]  # already imported: at once
        _verl_omni.when_imported("spd_hook_pkg.late", _SEEN.append)
        assert len(_SEEN) == 1
        import spd_hook_pkg.late

        assert [m.VALUE for m in _SEEN] == [1, 2]
        assert spd_hook_pkg.late.__loader__.get_source("spd_hook_pkg.late") == "VALUE = 2\n"  # real loader's
        import spd_hook_pkg.mid

        assert len(_SEEN) == 2  # mid-import: not yet
        import spd_hook_pkg.after

        assert [m.VALUE for m in _SEEN] == [1, 2, 3]
        _verl_omni.when_imported("spd_hook_pkg.never", _SEEN.append)
        _verl_omni.forget(_SEEN.append)
        assert not any(isinstance(f, _verl_omni._Finder) for f in sys.meta_path)  # nothing left behind
    finally:
        _verl_omni.forget(_SEEN.append)
        for name in [n for n in sys.modules if n.startswith("spd_hook_pkg")]:
            del sys.modules[name]


_SEEN: list = []


def test_without_verl_omni_its_patches_are_skipped_and_apply_revert_are_idempotent():
    from sp_diffusers.patching.patches import ALL_PATCHES, _verl_omni

    if _verl_omni.installed():
        pytest.skip("verl-omni is installed here: the stand-in tests above cover it")
    patches = [p for p in ALL_PATCHES if p.NAME in VERL_OMNI_PATCHES]
    assert [p.NAME for p in patches] == list(VERL_OMNI_PATCHES)  # all four, after the diffusers patches
    for patch in patches:
        result = patch.probe()
        assert not result.needed and "not installed" in result.reason
    # armed by hand (install() never does it here): one wait per module however often apply() runs
    for patch in patches:
        patch.apply()
        patch.apply()
    try:
        assert all(p.is_applied() for p in patches)
        assert all(len(fixes) == len(set(fixes)) for fixes in _verl_omni._hooks.values()), _verl_omni._hooks
        assert (
            set(_verl_omni._hooks)
            == {
                "verl_omni.workers.config.diffusion.model",
                "verl_omni.workers.engine.fsdp.diffusers_impl",
                "verl_omni.workers.engine.fsdp.omni_impl",
                "verl_omni.models.diffusers.qwen_image",
            }
            and len([f for fs in _verl_omni._hooks.values() for f in fs]) == 5
        )  # diffusers_impl: two patches
    finally:
        for patch in reversed(patches):
            patch.revert()
            patch.revert()
    assert not any(p.is_applied() for p in patches) and not _verl_omni._hooks
    assert not any(isinstance(f, _verl_omni._Finder) for f in sys.meta_path)
