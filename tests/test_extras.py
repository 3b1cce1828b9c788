"""Each extra of pyproject.toml resolves against the package index with pip's own resolver (a dry run:
metadata only, nothing installed), alone and inside the pins of a verl-omni environment, so a pin that
fights users' environments fails CI.

verl-omni's environment (its main after PR #497, docs/integrations.md): Python >= 3.11, transformers >= 5.13,
diffusers >= 0.40, vllm-omni 0.28.0. ``[verl]`` is verl 0.9.1 with verl's own pins (transformers < 5.11): it is
for verl users, never for a verl-omni environment (verl-omni pins a verl commit), and the test holds that it
conflicts there, as docs/integrations.md says. Needs the package index (CI reaches PyPI); each resolve has a
time limit, and an index that cannot be reached fails with that reason instead of a resolver error.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import tomllib
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = 300  # seconds per resolve; they run in parallel
VERL_OMNI = ["transformers>=5.13", "diffusers>=0.40", "vllm-omni==0.28.0"]
NEWEST_TRANSFORMERS = "5.23.0"  # the newest when issue 24 was written (5.24.0 since): [train] must keep it
NETWORK_ERRORS = (
    "NewConnectionError",
    "Temporary failure in name resolution",
    "Network is unreachable",
    "ConnectTimeoutError",
    "ReadTimeoutError",
    "No route to host",
)

# name: (extras, requirements beside them, packages the resolution must hold, or None: it must conflict).
# One resolve per environment (each costs tens of seconds of index requests): a verl-omni user may take
# [train] and [vllm-omni] together. [verl] alone is verl==0.9.1, which scripts/setup.sh installs for CI.
CASES = {
    "train + newest transformers": (("train",), [f"transformers=={NEWEST_TRANSFORMERS}"], {"transformers"}),
    "train, vllm-omni + verl-omni": (
        ("train", "vllm-omni"),
        VERL_OMNI,
        {"transformers", "diffusers", "vllm-omni"},
    ),
    "verl + verl-omni (conflicts)": (("verl",), VERL_OMNI, None),
}


def _requirements(extras: tuple[str, ...]) -> list[str]:
    """What ``pip install 'sp-diffusers[extra,...]'`` asks for: the dependencies plus each extra's."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [*project["dependencies"], *(r for e in extras for r in project["optional-dependencies"][e])]


def _resolve(case: str) -> dict:
    extras, pins, _ = CASES[case]
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--ignore-installed",
            "--quiet",
            "--disable-pip-version-check",
            "--timeout",
            "30",
            "--retries",
            "2",
            "--report",
            str(report),
            *_requirements(extras),
            *pins,
        ]
        env = {k: v for k, v in os.environ.items() if k != "PIP_FIND_LINKS"}  # the index, not local files
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, env=env)
        except subprocess.TimeoutExpired:
            return {"error": f"pip's resolver took over {TIMEOUT} s (is the package index reachable?)"}
        if any(e in proc.stderr for e in NETWORK_ERRORS):
            return {"error": f"the package index cannot be reached:\n{proc.stderr[-1500:]}"}
        if proc.returncode:
            return {"conflict": proc.stderr[-3000:]}
        installed = json.loads(report.read_text())["install"]
        return {"versions": {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in installed}}


@cache
def _resolutions() -> dict[str, dict]:
    with ThreadPoolExecutor(len(CASES)) as pool:
        return dict(zip(CASES, pool.map(_resolve, CASES), strict=True))


@pytest.mark.parametrize("case", CASES)
def test_extra_resolves_beside_users_pins(case):
    result = _resolutions()[case]
    assert "error" not in result, f"{case}: {result['error']}"
    expected = CASES[case][2]
    if expected is None:  # documented conflict: the resolver must refuse it
        assert "conflict" in result and "ResolutionImpossible" in result["conflict"], result
        assert "transformers" in result["conflict"]  # verl 0.9.1's < 5.11 against verl-omni's >= 5.13
        return
    assert "conflict" not in result, f"{case}: pip cannot resolve it:\n{result['conflict']}"
    versions = result["versions"]
    assert expected <= set(versions), sorted(versions)
    if case == "train + newest transformers":
        assert versions["transformers"] == NEWEST_TRANSFORMERS  # kept, not downgraded
    if "verl-omni" in case:
        assert versions["vllm-omni"] == "0.28.0"
        assert tuple(int(x) for x in versions["transformers"].split(".")[:2]) >= (5, 13)
        assert tuple(int(x) for x in versions["diffusers"].split(".")[:2]) >= (0, 40)
