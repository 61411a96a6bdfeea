"""Output handling shared by the converters: refuse an existing destination unless forced, build beside it, swap in.

A converter never writes into its destination directly. Directories are built in a temp directory beside the
destination and renamed into place at the end (an existing destination, with force, is renamed away first and
removed after the swap); single files go through `dart_core.io` atomic writes. On any error the temp directory is
removed, so a failed conversion leaves the destination as it was (absent, or the old one).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from typing import Iterable, Iterator

from dart_core.io import make_temp_dir


def _same_or_inside(path: str, other: str) -> bool:
    path, other = os.path.realpath(path), os.path.realpath(other)
    return path == other or path.startswith(other.rstrip(os.sep) + os.sep) or other.startswith(
        path.rstrip(os.sep) + os.sep)


def check_destination(dst: str, force: bool, sources: Iterable[str] = ()) -> str:
    """Absolute `dst` after checking it may be written: not a source (nor inside one), and absent unless `force`."""
    dst = os.path.abspath(os.fspath(dst))
    for src in sources:
        if src is not None and os.path.exists(src) and _same_or_inside(dst, os.fspath(src)):
            raise ValueError(f"destination {dst} is or overlaps the source {src}; choose another destination")
    if os.path.lexists(dst) and not force:
        raise FileExistsError(f"destination {dst} already exists; use --force (force=True) to replace it")
    return dst


def check_output_file(dst: str, force: bool, sources: Iterable[str] = ()) -> str:
    """`check_destination` for a single output file; its directory is created when missing."""
    dst = check_destination(dst, force, sources)
    if os.path.isdir(dst):
        raise ValueError(f"destination {dst} is a directory; give a file name (e.g. {dst}/ngram.safetensors)")
    parent = os.path.dirname(dst)
    blocker = next((p for p in _ancestors(parent) if os.path.lexists(p) and not os.path.isdir(p)), None)
    if blocker is not None:
        raise ValueError(f"cannot write {dst}: {blocker} is not a directory")
    os.makedirs(parent, exist_ok=True)
    return dst


def _ancestors(path: str) -> list[str]:
    """`path` and its parents, outermost first."""
    out = []
    while path and path not in out:
        out.append(path)
        path = os.path.dirname(path)
    return out[::-1]


@contextlib.contextmanager
def staged_directory(dst: str, force: bool, sources: Iterable[str] = ()) -> Iterator[str]:
    """Yield a temp directory beside `dst`; on success it becomes `dst` (replacing an old one only with `force`)."""
    dst = check_destination(dst, force, sources)
    parent = os.path.dirname(dst)
    os.makedirs(parent, exist_ok=True)
    tmp = make_temp_dir(parent, f".tmp-{os.path.basename(dst)}-")
    try:
        yield tmp
        _swap_in(tmp, dst, force)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _swap_in(tmp: str, dst: str, force: bool) -> None:
    if not os.path.lexists(dst):
        os.rename(tmp, dst)
        return
    if not force:  # appeared while we were converting
        raise FileExistsError(f"destination {dst} already exists; use --force (force=True) to replace it")
    old = tempfile.mkdtemp(prefix=f".old-{os.path.basename(dst)}-", dir=os.path.dirname(dst))
    moved = os.path.join(old, "previous")
    os.rename(dst, moved)
    try:
        os.rename(tmp, dst)
    except BaseException:
        os.rename(moved, dst)  # put the old one back
        raise
    finally:
        shutil.rmtree(old, ignore_errors=True)
