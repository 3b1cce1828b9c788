"""install()/uninstall(), the registry, compat errors, and bad configurations (single process + 4 ranks)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from ._dist import run_distributed


def test_import_changes_nothing():
    code = (
        "import sys, sp_diffusers\n"
        "assert 'diffusers' not in sys.modules, 'importing sp_diffusers imported diffusers'\n"
        "from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry\n"
        "from diffusers.models.modeling_utils import ModelMixin\n"
        "assert 'ulysses_sdpa' not in {m.value for m in AttentionBackendName}\n"
        "assert not hasattr(ModelMixin.set_attention_backend, '__wrapped__')\n"
        "assert not hasattr(_AttentionBackendRegistry._backends[AttentionBackendName.NATIVE], '__wrapped__')\n"
        "from sp_diffusers.patching.patches import ALL_PATCHES\n"
        "assert not any(p.is_applied() for p in ALL_PATCHES)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.fixture
def installed():
    import sp_diffusers

    report = sp_diffusers.install()
    yield report
    sp_diffusers.uninstall()


def test_install_is_idempotent_and_reports(installed):
    import diffusers

    import sp_diffusers
    from sp_diffusers.patching.patches import ALL_PATCHES

    assert sp_diffusers.install() is installed
    text = str(installed)
    assert diffusers.__version__ in text and "ulysses_sdpa" in text
    for patch in ALL_PATCHES:
        assert patch.NAME in text
        status = next(p for p in installed.patches if p.name == patch.NAME)
        assert status.applied == patch.is_applied()
        assert status.reason
        assert ("applied" if status.applied else "skipped") in next(
            line for line in text.splitlines() if patch.NAME in line
        )


def test_backend_is_a_real_enum_member(installed):
    from diffusers import attention_backend
    from diffusers.models.attention_dispatch import (
        AttentionBackendName,
        _AttentionBackendRegistry,
        dispatch_attention_fn,
    )

    from sp_diffusers.tiny import tiny_inputs, tiny_model

    member = AttentionBackendName("ulysses_sdpa")
    assert member.value == "ulysses_sdpa" and member in _AttentionBackendRegistry._backends
    assert _AttentionBackendRegistry._is_context_parallel_available(member)
    q = torch.randn(1, 8, 2, 4)
    with attention_backend("ulysses_sdpa"):
        out = dispatch_attention_fn(q, q, q)
    ref = torch.nn.functional.scaled_dot_product_attention(*(q.transpose(1, 2),) * 3).transpose(1, 2)
    assert torch.equal(out, ref)

    model = tiny_model("flux")
    reference = tiny_model("flux")
    model.set_attention_backend("ulysses_sdpa")
    inputs = tiny_inputs("flux", model)
    with torch.no_grad():
        assert torch.equal(model(**inputs, return_dict=False)[0], reference(**inputs, return_dict=False)[0])


def test_uninstall_reverts_everything():
    from diffusers.models.attention_dispatch import AttentionBackendName

    import sp_diffusers
    from sp_diffusers.patching.patches import ALL_PATCHES

    sp_diffusers.install()
    sp_diffusers.uninstall()
    sp_diffusers.uninstall()
    assert "ulysses_sdpa" not in {m.value for m in AttentionBackendName}
    assert not any(p.is_applied() for p in ALL_PATCHES)
    assert not sp_diffusers.is_installed()


def test_unsupported_diffusers_version_is_refused(monkeypatch):
    import diffusers

    from sp_diffusers.patching import compat

    compat.diffusers_version.cache_clear()
    monkeypatch.setattr(diffusers, "__version__", "0.35.2")
    try:
        with pytest.raises(compat.UnsupportedDiffusersError, match=r"0\.35\.2.*diffusers>=0\.36"):
            compat.check_supported()
    finally:
        compat.diffusers_version.cache_clear()


def test_bad_degrees_without_process_group(installed):
    import sp_diffusers

    with pytest.raises(ValueError, match="ulysses_degree must be a positive int, got 0"):
        sp_diffusers.context_parallel_config(ulysses_degree=0)


EXPECTED_WORDS = {
    "degree_exceeds_world": ["8", "world size 4", "fix"],
    "degree_not_dividing_world": ["3", "world size 4", "1, 2, 4"],
    "degree_zero": ["ulysses_degree", "0"],
    "degree_str": ["ulysses_degree", "'2'"],
    "mesh_without_ulysses": ["('sp',)", "ulysses", "build_device_mesh"],
    "mesh_size_mismatch": ["'ulysses' has size 4", "ulysses_degree=2"],
}


def test_bad_configurations_raise_clear_errors():
    for messages in run_distributed("tests.workers.config_errors:config_errors", 4):
        for name, words in EXPECTED_WORDS.items():
            assert messages[name] is not None, f"{name}: no error"
            for w in words:
                assert w in messages[name], f"{name}: {w!r} not in {messages[name]!r}"


def test_plans_are_attached_only_where_diffusers_has_none(installed):
    from diffusers import FluxTransformer2DModel, SD3Transformer2DModel

    from sp_diffusers.patching import plans

    statuses = {p.model_class: p for p in installed.plans}
    assert statuses["SD3Transformer2DModel"].attached
    assert "SD3Transformer2DModel" in str(installed) and "plan attached" in str(installed)
    assert SD3Transformer2DModel._cp_plan is not None
    assert FluxTransformer2DModel._cp_plan is not plans.registered_plans().get("FluxTransformer2DModel")


def test_user_registered_plan_is_attached_and_detached():
    from diffusers import SanaTransformer2DModel

    import sp_diffusers
    from sp_diffusers.patching import plans

    sp_diffusers.uninstall()
    plan = {"proj_out": "sentinel"}
    plans.register_plan(SanaTransformer2DModel, plan)
    try:
        report = sp_diffusers.install()
        assert SanaTransformer2DModel._cp_plan == plan
        assert any(p.model_class == "SanaTransformer2DModel" and p.attached for p in report.plans)
        sp_diffusers.uninstall()
        assert SanaTransformer2DModel._cp_plan is None
    finally:
        plans.assignments._PLANS.pop("SanaTransformer2DModel", None)
        sp_diffusers.uninstall()


def test_a_wheel_works_from_any_directory(tmp_path):
    """`pip install .` (not editable), then use it from another directory and from the source tree, whose
    own sp_diffusers/ comes first on sys.path there: both must find sp_diffusers.patching.patches."""
    import shutil
    import zipfile
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    src = tmp_path / "src"  # only what a build reads: the tree's build/ and egg-info stay untouched
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(root / name, src / name)
    shutil.copytree(root / "sp_diffusers", src / "sp_diffusers", ignore=shutil.ignore_patterns("__pycache__"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", tmp_path / "dist", src], check=True)
    (wheel,) = (tmp_path / "dist").glob("sp_diffusers-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    patch_files = {
        f"sp_diffusers/patching/patches/{p.name}" for p in (root / "sp_diffusers" / "patching" / "patches").glob("*.py")
    }
    assert len(patch_files) > 10 and patch_files <= names, sorted(patch_files - names)
    assert {n.split("/")[0] for n in names} == {"sp_diffusers", wheel.name.split("-py3")[0] + ".dist-info"}
    site = tmp_path / "site"
    subprocess.run([*pip, "install", "--no-deps", "--no-build-isolation", "--target", site, wheel], check=True)

    code = (
        "import sys\n"
        # the test environment's editable install would find sp_diffusers.patching.patches by its own map: drop it
        "sys.meta_path[:] = [f for f in sys.meta_path if '__editable__' not in getattr(f, '__module__', '')]\n"
        "import sp_diffusers, sp_diffusers.patching.patches as p\n"
        "report = sp_diffusers.install()\n"
        "assert any(s.applied for s in report.patches), str(report)\n"
        "print(sp_diffusers.__file__, p.__file__, sep='\\n')\n"
    )
    env = {k: v for k, v in __import__("os").environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(site)
    for cwd, expected in ((tmp_path, site), (root, root)):  # `python -c` puts the working directory first
        proc = subprocess.run(
            [sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
        )
        assert proc.returncode == 0, f"from {cwd}:\n{proc.stderr[-3000:]}"
        package, patches = proc.stdout.split()
        assert Path(package).is_relative_to(expected / "sp_diffusers"), (cwd, package)
        assert Path(patches).is_relative_to(expected / "sp_diffusers" / "patching" / "patches"), (cwd, patches)


def test_cpu_device_count_probe_survives_a_cuda_build_without_a_driver(monkeypatch):
    """PyPI's Linux torch is a CUDA build; on a host without the NVIDIA driver torch 2.7-2.10's
    ``torch.accelerator.device_count()`` raises where 2.11+ return 0. Both are a CPU-only host."""
    from sp_diffusers.patching.compat import diffusers_version
    from sp_diffusers.patching.patches import cpu_device_count as patch

    def no_driver() -> int:
        raise RuntimeError("Found no NVIDIA driver on your system. Please check that you have an NVIDIA GPU")

    monkeypatch.setattr(torch.accelerator, "device_count", no_driver)
    if diffusers_version().release[:2] != (0, 42):
        pytest.skip("the defect's method exists on diffusers 0.42 only (tests/test_patches.py covers others)")
    probe = patch.probe()
    assert probe.needed and "CPU-only" in probe.reason, probe
    with patch._cpu_counts_as_one_device():
        assert torch.accelerator.device_count() == 1
    with pytest.raises(RuntimeError, match="no NVIDIA driver"):  # restored afterwards
        torch.accelerator.device_count()
