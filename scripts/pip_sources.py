"""pip's configured package sources as uv arguments, one per line (uv does not read pip's configuration).

    python scripts/pip_sources.py

pip's configuration files and PIP_* variables (`pip config list`) may name an index (`index-url`), more indexes
(`extra-index-url`) and folders of wheels (`find-links`): on this project's machines the CPU build of torch is such
a wheel. setup.sh and lock.sh hand them to uv, so that uv resolves and installs from where pip would.
"""

from __future__ import annotations

import shlex
import subprocess
import sys

OPTIONS = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links"}


def sources() -> list[str]:
    listing = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=False
    ).stdout
    index: list[str] = []  # pip lists its environment variables first, and they win over the files
    args: list[str] = []
    for line in listing.splitlines():
        key, _, value = line.partition("=")
        option = OPTIONS.get(key.rpartition(".")[2])
        for item in shlex.split(value)[0].split() if option and value else []:
            if option == "--index-url":
                index = index or [option, item]
            elif item not in args:
                args += [option, item]
    return index + args


if __name__ == "__main__":
    print("\n".join(sources()))
