"""Atomic file writes and safe loading (safetensors + JSON only; nothing is ever unpickled)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


class OutputError(ValueError):
    """An output path cannot be written (a file in the way, no permission, or existing results)."""


def _temp_prefix(path: Path) -> str:
    return f".{path.name}."


def remove_stale_temps(path: str | os.PathLike) -> list[Path]:
    """Delete temporary files that interrupted writes of ``path`` left behind (their writing
    process is gone, e.g. killed with SIGKILL); files of live writers are kept."""
    path = Path(path)
    removed = []
    for tmp in path.parent.glob(f"{_temp_prefix(path)}*.tmp") if path.parent.is_dir() else ():
        pid = tmp.name[len(_temp_prefix(path)) :].split(".", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            if tmp.is_dir():
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                tmp.unlink(missing_ok=True)
            removed.append(tmp)
    return removed


def atomic_dir(path: str | os.PathLike, write: Callable[[Path], None]) -> Path:
    """Call ``write(tmp)`` on a temporary directory beside ``path``, then rename it to ``path``
    (replacing what was there): ``path`` is either absent, the old directory or the complete new
    one, never half written. Leftovers of a killed writer go at the next call."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(path)
    tmp = Path(tempfile.mkdtemp(prefix=f"{_temp_prefix(path)}{os.getpid()}.", suffix=".tmp", dir=path.parent))
    try:
        write(tmp)
        os.chmod(tmp, 0o777 & ~_umask())
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # this process is not writing this file now: an earlier write was interrupted
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def atomic_write(path: str | os.PathLike, write: Callable[[Path], None]) -> Path:
    """Call ``write(tmp)`` on a temporary file beside ``path``, then rename it into place.

    Readers see either the old file or the complete new one, never a partial write. The temporary
    file is named after this process, so the next write of ``path`` removes what a killed writer
    left (`remove_stale_temps`). The result has the usual permissions (umask), not mkstemp's 0600.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(path)
    fd, tmp = tempfile.mkstemp(prefix=f"{_temp_prefix(path)}{os.getpid()}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(Path(tmp))
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def atomic_write_json(path: str | os.PathLike, data: Any) -> Path:
    return atomic_write_text(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


def sha256_file(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def read_json(path: str | os.PathLike, what: str = "JSON file") -> Any:
    """A JSON file's content; ValueError naming the file where it is missing or not JSON."""
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{what} {path} does not exist") from None
    except IsADirectoryError:
        raise ValueError(f"{what} {path} is a directory, not a file") from None
    except UnicodeDecodeError:
        raise ValueError(f"{what} {path} is not UTF-8 text") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{what} {path} is not valid JSON (line {exc.lineno}: {exc.msg})") from None


def _probe_writable(folder: Path) -> None:
    """Raise OutputError unless a file can be created in ``folder`` or its nearest existing parent."""
    existing = folder
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise OutputError(f"cannot write under {folder}: {existing} is a file, not a directory")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as exc:
        raise OutputError(f"cannot write under {existing}: {exc.strerror or exc}") from None


def check_output_file(path: str | os.PathLike, suffixes: tuple[str, ...] = ()) -> Path:
    """Check, before any work, that ``path`` can be written as a file (an existing file is replaced)."""
    path = Path(path)
    if path.is_dir():
        raise OutputError(f"output {path} is a directory; name a file")
    if suffixes and path.suffix not in suffixes:
        raise OutputError(f"output {path} must end in {' or '.join(suffixes)}")
    _probe_writable(path.parent)
    return path


def check_output_dir(
    path: str | os.PathLike,
    finished: str | None = None,
    resumable: tuple[str, ...] = (),
    overwrite: bool = True,
) -> Path:
    """Check, before any work, that ``path`` can be written as a directory.

    ``overwrite=False`` (model outputs): a directory holding ``finished`` (the marker of a
    complete result) or anything outside ``resumable`` (what an interrupted run of the same
    command leaves, which it resumes) is refused: results are never mixed with stale files.
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise OutputError(f"output {path} is a file; name a directory")
    _probe_writable(path)
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


def config_digest(config: dict[str, Any]) -> str:
    """SHA-256 of the canonical JSON of every field but ``config_sha256`` itself: saved configs
    carry it, so an edited config is refused on load."""
    body = {k: v for k, v in config.items() if k != "config_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


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
