"""The locks scripts/setup.sh installs (locks/*.txt, written by scripts/lock.sh) and its environment check.

Each profile's lock is a subset of the next at the same versions (main < verl < test), so moving a venv between
profiles never changes a version; every pin satisfies pyproject.toml's ranges (the locks are one choice inside what
users may install); and the environment check names the package whose code raised, not the import that wrapped it.
"""

from __future__ import annotations

import importlib.util
import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
PROFILES = {"main": ("train",), "verl": ("train", "verl"), "test": ("train", "verl", "dev")}


def _pins(profile: str) -> dict[str, Version]:
    pins = {}
    for line in (ROOT / "locks" / f"{profile}.txt").read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", line)
        if m:
            pins[canonicalize_name(m.group(1))] = Version(m.group(2))
    return pins


def test_each_profile_is_a_subset_of_the_next_at_the_same_versions():
    main, verl, test = _pins("main"), _pins("verl"), _pins("test")
    assert len(main) < len(verl) < len(test)
    for small, big, name in ((main, verl, "main < verl"), (verl, test, "verl < test")):
        moved = {p: (v, big.get(p)) for p, v in small.items() if big.get(p) != v}
        assert not moved, f"{name}: {moved}"


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_every_pin_satisfies_pyproject(profile):
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = _pins(profile)
    wanted = [
        *project["dependencies"],
        *(r for e in PROFILES[profile] for r in project["optional-dependencies"][e]),
    ]
    checked = 0
    for text in wanted:
        req = Requirement(text)
        if canonicalize_name(req.name) == "sp-diffusers":  # [dev] names the project's own [train]
            continue
        version = pins.get(canonicalize_name(req.name))
        assert version is not None, f"locks/{profile}.txt lacks {req.name} ({text})"
        # a local build label (torch's +cpu) is the same release
        assert req.specifier.contains(Version(version.public), prereleases=True), (profile, text, version)
        checked += 1
    assert checked >= 3
    # what CI tests: the CPU build of torch 2.13.0, diffusers 0.42.1, no kernels beside transformers < 5.11
    assert str(pins["torch"]) == "2.13.0+cpu" and str(pins["diffusers"]) == "0.42.1"
    assert "kernels" not in pins, (
        "transformers < 5.11 raises at import beside kernels >= 0.19 (troubleshooting.md)"
    )


def _check_env():
    spec = importlib.util.spec_from_file_location("check_env", ROOT / "scripts" / "check_env.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_environment_check_names_the_package_that_raised(monkeypatch, capsys):
    check_env = _check_env()
    # an installed package's own error, wrapped as diffusers' lazy imports wrap it: the root and its package
    try:
        try:
            Version("not a version")
        except Exception as inner:
            raise RuntimeError("Failed to import diffusers.something") from inner
    except RuntimeError as outer:
        root = check_env._root_cause(outer)
    assert type(root).__name__ == "InvalidVersion"
    assert re.match(r"packaging \S+ \(packaging/version\.py:\d+\)", check_env._culprit(root)), (
        check_env._culprit(root)
    )
    # smoke: one line naming the package, exit status 1
    monkeypatch.setitem(check_env.SMOKE, "main", ["packaging.version", "a_module_that_is_not_installed"])
    monkeypatch.setitem(check_env.PROFILES, "main", ["main"])
    assert check_env.main(["smoke", "main"]) == 1
    out = capsys.readouterr().out.strip().splitlines()
    assert out == [
        "broken package: a_module_that_is_not_installed: importing a_module_that_is_not_installed raised "
        "ModuleNotFoundError: No module named 'a_module_that_is_not_installed'"
    ], out
    assert check_env.main(["nonsense"]) == 2
