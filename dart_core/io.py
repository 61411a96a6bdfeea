"""File helpers shared by the core, the adapters, training and the converters: atomic writes, checked safetensors
loading, and output directories built beside their destination and swapped in whole (`staged_directory`): a job
that fails leaves the destination as it was (absent, or the old one)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from typing import Iterable, Iterator, Mapping, Optional

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from dart_core.errors import DartInputError


# the floating dtypes a head is stored in, by the names the command line and configs use
WEIGHT_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def cache_root() -> str:
    """Where the project caches what it measures or converts: `$DART_SPEC_CACHE`, else `~/.cache/dart-spec`."""
    return os.environ.get("DART_SPEC_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "dart-spec")


def read_json_object(file: str) -> dict:
    """A JSON object from `file`; FileNotFoundError / DartInputError name the file and the problem."""
    if not os.path.isfile(file):
        raise FileNotFoundError(f"no {os.path.basename(file)} at {file}")
    try:
        with open(file, encoding="utf-8") as fh:
            raw = json.load(fh)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise DartInputError(f"{file} is not valid JSON: {err}") from err
    if not isinstance(raw, dict):
        raise DartInputError(f"{file} does not hold a JSON object")
    return raw


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def make_temp_dir(parent: str | os.PathLike, prefix: str) -> str:
    """A new temp directory in `parent` with the permissions mkdir would give (mkdtemp makes it 0700): the
    staging place of an output directory that is renamed into place when complete."""
    tmp = tempfile.mkdtemp(prefix=prefix, dir=parent)
    os.chmod(tmp, 0o777 & ~_umask())
    return tmp


def check_rewritable(path: str) -> None:
    """Before `path` is rewritten in place by an atomic replace: refuse a symbolic link or a file with other hard
    links (a Hugging Face cache snapshot's files are links into its blob store), which the replace would turn into a
    separate regular file while the file they point to, or share, kept the old content. DartInputError says why."""
    if os.path.islink(path):
        raise DartInputError(f"{path} is a symbolic link (to {os.path.realpath(path)}): rewriting it would replace the "
                             "link with a copy and leave the file it points to unchanged, and writing through it would "
                             "change a file other links may share (as in a Hugging Face cache snapshot). Copy the "
                             "directory with its files (cp -rL) and run on the copy")
    if os.path.isfile(path) and os.stat(path).st_nlink > 1:
        raise DartInputError(f"{path} has {os.stat(path).st_nlink - 1} other hard link(s): rewriting it would give "
                             "it a copy of its own and leave the others unchanged. Copy the directory and run on the "
                             "copy")


@contextlib.contextmanager
def atomic_write(path: str, mode: str = "wb") -> Iterator:
    """Open a temp file beside `path`; on success it replaces `path`, on error it is removed."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix="-" + os.path.basename(path), dir=directory)
    try:
        with os.fdopen(fd, mode) as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp creates 0600; give the file the permissions open() would
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def save_safetensors_atomic(tensors: Mapping[str, torch.Tensor], path: str,
                            metadata: Optional[dict[str, str]] = None) -> None:
    """Write a safetensors file so that readers see either the old file or the complete new one."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix="-" + os.path.basename(path), dir=directory)
    os.close(fd)
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, tmp, metadata=metadata)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp creates 0600; give the file the permissions open() would
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


_SAFETENSORS_DTYPE_NAMES = {"int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8",
                            "float64": "F64", "float32": "F32", "float16": "F16", "bool": "BOOL"}


def write_safetensors_arrays(arrays: Mapping[str, np.ndarray], path: str,
                             metadata: Optional[dict[str, str]] = None) -> None:
    """Write numpy arrays as a safetensors file without an in-memory copy of the data, atomically.

    (safetensors' own writer builds the whole file in memory first; for multi-GB n-gram tables that doubles the
    peak memory.)
    """
    header: dict = {}
    offset = 0
    ordered = [(name, np.ascontiguousarray(a)) for name, a in arrays.items()]
    for name, a in ordered:
        kind = _SAFETENSORS_DTYPE_NAMES.get(a.dtype.name)
        if kind is None or a.dtype.byteorder == ">":
            raise DartInputError(f"cannot store array {name!r} of dtype {a.dtype} in safetensors")
        header[name] = {"dtype": kind, "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    if metadata:
        header["__metadata__"] = dict(metadata)
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-(len(raw) + 8) % 8)  # data starts 8-byte aligned
    with atomic_write(path, "wb") as fh:
        fh.write(len(raw).to_bytes(8, "little"))
        fh.write(raw)
        for _, a in ordered:
            if a.size:
                a.tofile(fh)


def load_safetensors_checked(path: str, expected: Mapping[str, tuple[int, ...]],
                             optional: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """Load `path` and check it holds exactly the `expected` keys with the expected shapes.

    Keys in `optional` may be present (their shapes are not checked). Errors name the file, the key and the shapes.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"weights file not found: {path}")
    try:
        state = load_file(path)
    except (SafetensorError, OSError, ValueError) as err:
        raise DartInputError(f"{path}: not a readable safetensors file ({err})") from err
    missing = [k for k in expected if k not in state]
    if missing:
        k = missing[0]
        raise DartInputError(f"{path}: missing key {k!r} (expected shape {list(expected[k])})"
                             + (f" and {len(missing) - 1} more: {missing[1:6]}" if len(missing) > 1 else ""))
    unknown = [k for k in state if k not in expected and k not in optional]
    if unknown:
        raise DartInputError(f"{path}: unknown key(s) {unknown[:6]}; a DART head holds {sorted(expected)[:6]}...")
    for k, shape in expected.items():
        if tuple(state[k].shape) != tuple(shape):
            raise DartInputError(f"{path}: key {k!r} has shape {list(state[k].shape)}, expected {list(shape)}")
    return state


# ---- output directories and files: refuse what would destroy input, build beside the destination, swap in ------------
def is_inside(path: str | os.PathLike, directory: str | os.PathLike) -> bool:
    """Whether `path` lies strictly inside `directory` (links resolved)."""
    return os.path.realpath(path).startswith(os.path.realpath(directory).rstrip(os.sep) + os.sep)


def _same_or_inside(path: str, other: str) -> bool:
    same = os.path.realpath(path) == os.path.realpath(other)
    return same or is_inside(path, other) or is_inside(other, path)


def refuse_overlap(dst: str | os.PathLike, sources: Iterable[Optional[str | os.PathLike]]) -> str:
    """Absolute `dst` after checking that no existing source path is `dst`, lies inside it or holds it: the one rule
    that keeps every input of a command from being overwritten (None entries are skipped)."""
    dst = os.path.abspath(os.fspath(dst))
    for src in sources:
        if src is not None and os.path.exists(src) and _same_or_inside(dst, os.fspath(src)):
            raise DartInputError(f"destination {dst} is or overlaps the source {os.fspath(src)}; "
                                 "choose another destination")
    return dst


def check_destination(dst: str, force: bool, sources: Iterable[Optional[str]] = ()) -> str:
    """Absolute `dst` after checking it may be written: no input overlaps it (`refuse_overlap`), and it is absent
    unless `force`."""
    dst = refuse_overlap(dst, sources)
    if os.path.lexists(dst) and not force:
        raise FileExistsError(f"destination {dst} already exists; use --force (force=True) to replace it")
    return dst


def check_output_file(dst: str, force: bool, sources: Iterable[str] = ()) -> str:
    """`check_destination` for a single output file; its directory is created when missing."""
    dst = check_destination(dst, force, sources)
    if os.path.isdir(dst):
        raise DartInputError(f"destination {dst} is a directory; give a file name (e.g. {dst}/ngram.safetensors)")
    parent = os.path.dirname(dst)
    blocker = next((p for p in _ancestors(parent) if os.path.lexists(p) and not os.path.isdir(p)), None)
    if blocker is not None:
        raise DartInputError(f"cannot write {dst}: {blocker} is not a directory")
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
        if os.path.lexists(dst) and not force:  # appeared while the output was being built
            raise FileExistsError(f"destination {dst} already exists; use --force (force=True) to replace it")
        replace_directory(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# the prefix of the directory that holds a destination's old copy while the new one is swapped in
ASIDE_PREFIX = ".old-"


def replace_directory(tmp: str, dst: str) -> None:
    """Move the finished directory `tmp` to `dst`, replacing an existing one: the old copy waits in a new directory
    of a fresh name beside `dst` (`set_aside_copies`) until the new one is in place (put back if that fails), so a
    crash leaves one complete copy. Only that new directory is ever removed: no other path is touched."""
    aside = None
    if os.path.lexists(dst):
        aside = make_temp_dir(os.path.dirname(dst), f"{ASIDE_PREFIX}{os.path.basename(dst)}-")
        os.replace(dst, os.path.join(aside, os.path.basename(dst)))
    try:
        os.replace(tmp, dst)
    except BaseException:
        if aside is not None and not os.path.lexists(dst):
            os.replace(os.path.join(aside, os.path.basename(dst)), dst)
            os.rmdir(aside)
        raise
    if aside is not None:
        shutil.rmtree(aside)


def set_aside_copies(dst: str | os.PathLike) -> list[str]:
    """The old copies of `dst` that an interrupted `replace_directory` left beside it, newest first (each
    `<parent>/.old-<name>-XXXX/<name>`)."""
    dst = os.path.abspath(os.fspath(dst))
    parent, name = os.path.split(dst)
    if not os.path.isdir(parent):
        return []
    holders = [os.path.join(parent, entry) for entry in os.listdir(parent)
               if entry.startswith(f"{ASIDE_PREFIX}{name}-") and os.path.isdir(os.path.join(parent, entry))
               and os.listdir(os.path.join(parent, entry)) == [name]]
    return [os.path.join(h, name) for h in sorted(holders, key=os.path.getmtime, reverse=True)]
