"""The command line's guards on what a command writes: every output checked before any work
(a file, a folder, a report folder; never over an input), one process per output (a lock), and
a finished result replaced only whole. Their refusals name the options (``--out``,
``--overwrite``); the library's own checks (`hydra_ensembles.saving.files`) name none."""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hydra_ensembles.saving.files import (
    OutputError,
    atomic_write_text,
    check_replaceable_dir,
    check_writable_dir,
    probe_writable,
)


def check_output_file(path: str | os.PathLike, suffixes: tuple[str, ...] = ()) -> Path:
    """Check, before any work, that ``path`` can be written as a file (an existing file is replaced)."""
    path = Path(path)
    if path.is_dir():
        raise OutputError(f"output {path} is a directory; name a file")
    if suffixes and path.suffix not in suffixes:
        raise OutputError(f"output {path} must end in {' or '.join(suffixes)}")
    probe_writable(path.parent)
    return path


def check_output_dir(
    path: str | os.PathLike,
    finished: str | None = None,
    resumable: tuple[str, ...] = (),
    overwrite: bool = True,
    replaced: bool = False,
) -> Path:
    """Check, before any work, that ``path`` can be written as a directory.

    ``overwrite=False`` (model outputs): a directory holding ``finished`` (the marker of a
    complete result) or anything outside ``resumable`` (what an interrupted run of the same
    command leaves, which it resumes) is refused: results are never mixed with stale files.
    ``replaced``: the folder is replaced as a whole (`io.check_replaceable_dir`): allowed only for
    an empty folder or one hydra-ens wrote, even with ``overwrite``.
    """
    path = Path(path)
    if replaced:
        check_replaceable_dir(
            path, "choose another --out (--overwrite replaces only a folder this command wrote)"
        )
    else:
        check_writable_dir(path)
    if overwrite or not path.is_dir():
        return path
    entries = {p.name for p in path.iterdir()}
    if finished and (path / finished).exists():
        raise OutputError(f"{path} already holds a result: pass --overwrite to replace it, or another --out")
    foreign = sorted(e for e in entries if e not in resumable)
    if foreign:
        raise OutputError(
            f"{path} is not empty ({', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}); "
            "choose another --out or pass --overwrite"
        )
    return path


def overwrite_staging(path: Path, finished: str, owned: tuple[str, ...]) -> Path:
    """Where a resumable command that writes the folder ``path`` step by step (``build``) writes:
    ``path`` itself, unless it holds a finished result (``finished``) that ``--overwrite``
    replaces; then ``.NAME.overwrite`` beside it, which a killed rerun resumes from and
    `replace_dir` moves into place at the end, so ``path`` holds the old result or the new one,
    never a mix. A finished folder holding entries other than ``owned`` (the user's own files,
    which replacing it would delete) is refused."""
    if not (path / finished).exists():
        return path
    foreign = sorted(p.name for p in path.iterdir() if p.name not in owned)
    if foreign:
        raise OutputError(
            f"{path} holds files hydra-ens did not write ({', '.join(foreign[:3])}), which replacing it "
            "would delete: choose another --out (--overwrite replaces only what this command wrote)"
        )
    return path.parent / f".{path.name}.overwrite"


REPORT_MARKER = ".hydra-ens-report"
"""The file that marks a report folder as written by hydra-ens (so a rerun may replace its files)."""


def check_report_dir(path: str | os.PathLike, overwrite: bool = False) -> Path:
    """Check, before any work, that ``path`` may receive a report: a new or empty folder, or one
    a report was written to before (`REPORT_MARKER`); a folder of the user's own files is
    refused unless ``overwrite``. `mark_report_dir` marks it before the first file is written."""
    path = check_output_dir(path)
    if overwrite or not path.is_dir() or (path / REPORT_MARKER).is_file():
        return path
    entries = sorted(p.name for p in path.iterdir())
    if entries:
        raise OutputError(
            f"{path} holds files this tool did not write ({', '.join(entries[:3])}"
            f"{', ...' if len(entries) > 3 else ''}): choose another --out, or pass --overwrite "
            "to write the report there (files of the same names are replaced)"
        )
    return path


def mark_report_dir(path: str | os.PathLike) -> Path:
    """Create the report folder ``path`` and its marker (`check_report_dir`)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    marker = path / REPORT_MARKER
    if not marker.is_file():
        atomic_write_text(marker, "A report folder written by hydra-ens: its files are replaced by reruns.\n")
    return path


@contextlib.contextmanager
def output_lock(path: str | os.PathLike) -> Iterator[None]:
    """Hold an exclusive lock on the output ``path`` (a ``.NAME.lock`` file beside it) while a
    command writes it: a second process writing the same output is refused with OutputError
    instead of silently replacing the first one's result. Folders created for the lock are
    removed again if nothing else was written there."""
    try:
        import fcntl
    except ImportError:  # no flock (Windows): no lock
        yield
        return
    target = Path(path).resolve()
    probe_writable(target.parent)
    created = []
    folder = target.parent
    while not folder.exists():
        created.append(folder)
        folder = folder.parent
    lock = target.parent / f".{target.name}.lock"
    try:
        fd = _take_lock(fcntl, lock, path)
        try:
            yield
        finally:
            lock.unlink(missing_ok=True)
            os.close(fd)
    finally:
        for folder in created:  # innermost first
            try:
                folder.rmdir()
            except OSError:
                break


def _take_lock(fcntl: Any, lock: Path, path: str | os.PathLike) -> int:
    """The open, exclusively locked descriptor of ``lock`` (see `output_lock`). The lock file is
    opened without following a symbolic link and must be a regular file: a link planted in the
    output's folder would otherwise have the lock truncate whatever file it points to."""
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
        while True:
            try:
                fd = os.open(lock, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o666)
            except OSError as exc:
                if lock.is_symlink():
                    raise OutputError(
                        f"{lock} is a symbolic link, not a lock file: remove it (it may have been "
                        "planted to make this command overwrite another file)"
                    ) from None
                raise exc
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                raise OutputError(f"{lock} is not a regular file: remove it")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise OutputError(
                    f"another process is writing {path} (it holds {lock}): wait for it to finish, "
                    "or choose another output"
                ) from None
            try:  # its last holder may have removed the file meanwhile: then lock the new one
                if os.fstat(fd).st_ino == os.stat(lock).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        return fd
    except OSError as exc:
        raise OutputError(f"cannot write under {lock.parent}: {exc.strerror or exc}") from None


def check_outputs_apart(outputs: dict[str, str | os.PathLike], inputs: list[str | os.PathLike]) -> None:
    """Refuse, before any work, an output that is, contains or lies inside an input (paths
    resolved, symbolic links followed), or two outputs that overlap: writing it would destroy the
    input (``predict --data d.csv --out d.csv``, ``score M --out M/config.json``). ``outputs``
    maps each option's name (``--out``) to its path; ``inputs`` are the paths a command reads
    (names that are no existing path, such as hub ids or built-in names, are ignored)."""
    resolved_inputs = [(Path(p), Path(p).resolve()) for p in inputs if p and Path(p).exists()]
    seen: list[tuple[str, Path]] = []
    for option, path in outputs.items():
        if not path:
            continue
        out = Path(path).resolve()
        for given, source in resolved_inputs:
            if out == source or source in out.parents or out in source.parents:
                relation = "is" if out == source else ("lies inside" if source in out.parents else "contains")
                raise OutputError(f"{option} {path} {relation} the input {given}: choose another {option}")
        for other, earlier in seen:
            if out == earlier or earlier in out.parents or out in earlier.parents:
                raise OutputError(
                    f"{option} {path} overlaps {other} {outputs[other]}: give them separate paths"
                )
        seen.append((option, out))
