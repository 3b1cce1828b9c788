"""The diffusers compatibility matrix: every minor release with ContextParallelConfig, each installed with
``pip install --no-deps --target <dir>/<version> diffusers==<version>`` by ``scripts/setup.sh``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

MATRIX_VERSIONS = ("0.36.0", "0.37.1", "0.38.0", "0.39.0", "0.40.0", "0.41.0", "0.42.1")
ROOT = Path(__file__).resolve().parent.parent


def matrix_dir() -> Path:
    return Path(os.environ.get("SP_DIFFUSERS_MATRIX_DIR", ROOT / ".dmatrix"))


def sys_path_for(version: str) -> list[str]:
    path = matrix_dir() / version
    if not (path / "diffusers" / "__init__.py").exists():
        pytest.fail(
            f"diffusers {version} is not installed under {path}; run `bash scripts/setup.sh` "
            "(or set SP_DIFFUSERS_MATRIX_DIR) to install the compatibility matrix"
        )
    return [str(path)]


def minor(version: str) -> tuple[int, int]:
    major, mnr, *_ = (int(x) for x in version.split("."))
    return major, mnr
