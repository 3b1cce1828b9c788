"""Where ``sp-diffusers export`` writes: a staging folder beside the target, renamed into place whole at the end.

Nothing a user already has is overwritten or corrupted:

- **Atomic.** Everything is written into ``.<name>.partial-<pid>@<host>.<random>`` next to ``--out`` (the same
  file system, so the final rename is a rename, not a copy) and published by one rename. An export already at
  ``--out`` is swapped out in one step (Linux ``renameat2(RENAME_EXCHANGE)``) and only then removed; where the
  system has no exchange, it is first renamed aside to ``.<name>.previous-<pid>@<host>.d``, and a later export puts
  it back if the process died between the two renames. A killed export leaves the previous one as it was (and its
  staging folder, which the next export of that target on the same host removes once its process is gone).
- **Only an export is replaced, and only with ``--force``.** An export is recognised by ``sp_diffusers_export.json``
  at its top; an existing folder without it (a pipeline, a run, anything else) is refused, with or without
  ``--force``; an empty folder is taken.
- **No shared inodes unless asked.** Files taken from the source pipeline are copy-on-write clones where the file
  system offers them (``FICLONE``: btrfs, XFS, bcachefs; the data blocks are shared, the inode is not, so a write
  into one copy never reaches the other) and plain copies otherwise. ``--link`` hard-links them instead (no space,
  one inode) and makes each linked file read-only, so that a later write into the export fails instead of
  rewriting the source pipeline's file (which is the same file, and becomes read-only with it).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import glob
import json
import os
import shutil
import socket
import stat
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

from ..config import ConfigError

__all__ = ["MARKER", "copy_file", "copy_tree", "prepare_target", "publish", "read_marker", "staging_folder"]

MARKER = "sp_diffusers_export.json"  # what makes a folder an export (and says of which run and step)
_FICLONE = 0x40049409  # linux/fs.h: _IOW(0x94, 9, int)
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def read_marker(folder: Path) -> dict[str, Any] | None:
    """The export marker of ``folder`` (None: not an export)."""
    path = folder / MARKER
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError:
        return {}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _tag(out: Path, kind: str) -> str:
    """``.<name>.<kind>-<pid>@<host>.``: whose staging (``partial``) or set-aside (``previous``) folder it is."""
    return f".{out.name}.{kind}-{os.getpid()}@{socket.gethostname()}."


def _leftovers(out: Path, kind: str) -> list[tuple[Path, int]]:
    """``(path, pid)`` of this host's ``.<name>.<kind>-<pid>@<host>.`` folders beside ``out`` (another host's
    processes cannot be asked whether they still run: their folders are left alone)."""
    found = []
    head, host = f".{out.name}.{kind}-", f"@{socket.gethostname()}."
    for path in out.parent.glob(glob.escape(head) + "*"):
        pid, sep, rest = path.name[len(head) :].partition("@")
        if pid.isdigit() and sep and ("@" + rest).startswith(host):
            found.append((path, int(pid)))
    return found


def _recover(out: Path) -> str | None:
    """Put back a previous export that a dead export moved aside and never replaced (no-exchange systems only)."""
    for path, pid in _leftovers(out, "previous"):
        if _alive(pid):
            continue
        if not out.exists():
            os.rename(path, out)
            return f"restored the previous export {out} from {path.name} (an export was interrupted while replacing it)"
        shutil.rmtree(path, ignore_errors=True)
    return None


def prepare_target(out: Path, force: bool) -> tuple[bool, list[str]]:
    """Check that ``--out`` may be written: ``(an export is there and will be replaced, notes)``; ``ConfigError``
    naming ``--out`` and the fix otherwise. Removes staging folders of exports to ``out`` whose process is gone."""
    notes = []
    if out.parent.exists():
        for path, pid in _leftovers(out, "partial"):
            if not _alive(pid):
                shutil.rmtree(path, ignore_errors=True)
                notes.append(f"removed {path.name}, the staging folder of an interrupted export")
        restored = _recover(out)
        if restored:
            notes.append(restored)
    try:
        return _replaces(out, force), notes
    except ConfigError as err:
        if not notes:
            raise
        raise ConfigError(f"{err} (before that: {'; '.join(notes)})") from None


def _replaces(out: Path, force: bool) -> bool:
    """Whether ``out`` holds an export to replace (False: nothing there yet); ``ConfigError`` where it may not go."""
    if out.is_symlink():
        raise ConfigError(f"--out {out} is a symbolic link; fix: --out the folder itself ({os.path.realpath(out)})")
    if not out.exists():
        return False
    if not out.is_dir():
        raise ConfigError(f"--out {out} is a file; fix: --out a new folder (it is created)")
    marker = read_marker(out)
    if marker is None:
        if not any(out.iterdir()):
            return False
        raise ConfigError(
            f"--out {out} holds files and is not an export (no {MARKER}); export never writes into such a folder, "
            "even with --force, so nothing of yours (a pipeline, a run) is overwritten; fix: --out a new folder"
        )
    if not force:
        what = f" of {marker.get('run', '?')} at {marker.get('step', '?')}" if marker else ""
        raise ConfigError(
            f"--out {out} already holds an export{what}; fix: --force to replace it (whole: nothing of it is kept), "
            "or --out another folder"
        )
    return True


def staging_folder(out: Path) -> Path:
    """A new empty folder beside ``out`` to write the export into (``publish`` renames it into place)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=_tag(out, "partial"), dir=out.parent))
    umask = os.umask(0o022)
    os.umask(umask)
    os.chmod(stage, 0o777 & ~umask)  # mkdtemp's 0o700 would become the export's own mode: as mkdir makes it
    return stage


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux ``renameat2``); False where the system or file system cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, f"exchanging {a} and {b}: {os.strerror(err)}")


def publish(stage: Path, out: Path, replace: bool) -> None:
    """Rename the finished ``stage`` to ``out``; the export that was there (``replace``) goes only after."""
    if not replace:
        try:
            os.rename(stage, out)  # onto nothing, or an empty folder
        except OSError as err:
            if err.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):
                raise
            raise ConfigError(
                f"--out {out} was written by something else while this export ran (another export?); this one is "
                "dropped and that one kept; fix: run the export again (with --force to replace what is there)"
            ) from None
        return
    if _exchange(stage, out):
        shutil.rmtree(stage)  # now the previous export
        return
    aside = out.parent / (_tag(out, "previous") + "d")
    os.rename(out, aside)
    os.rename(stage, out)
    shutil.rmtree(aside)


def _clone(src: str, dst: str) -> bool:
    """A copy-on-write clone of ``src`` at ``dst`` (False where the file system has none)."""
    try:
        import fcntl
    except ImportError:  # not a POSIX system
        return False
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        try:
            fcntl.ioctl(fout.fileno(), _FICLONE, fin.fileno())
        except OSError:
            return False
    return True


def copy_file(src: str | Path, dst: str | Path, link: bool = False) -> str:
    """``src`` to ``dst`` as ``"clone"``, ``"copy"`` or (``link``) ``"link"``: how it was done."""
    src, dst = str(src), str(dst)
    if link:
        try:
            os.link(src, dst)
        except OSError as err:
            if err.errno != errno.EXDEV:
                raise
        else:
            mode = stat.S_IMODE(os.stat(dst).st_mode)
            os.chmod(dst, mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
            return "link"
    how = "clone" if _clone(src, dst) else "copy"
    if how == "copy":
        with contextlib.suppress(FileNotFoundError):
            os.unlink(dst)
        shutil.copyfile(src, dst)
    shutil.copystat(src, dst)
    return how


def copy_tree(src: Path, dst: Path, link: bool = False) -> Counter:
    """Every file under ``src`` to ``dst`` (created) by :func:`copy_file`; symbolic links are followed, so the
    export holds the files themselves (a downloaded repository's links point into a cache). Counts by how."""
    counts: Counter = Counter()
    dst.mkdir(parents=True, exist_ok=True)
    for entry in sorted(src.iterdir()):
        target = dst / entry.name
        if entry.is_dir():
            counts += copy_tree(entry, target, link)
        else:
            counts[copy_file(entry, target, link)] += 1
    return counts
