"""Atomic file writes and safe loading (safetensors + JSON only; nothing is ever unpickled)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ..errors import InputError
from ..hashing import sha256_file


class OutputError(InputError):
    """An output path cannot be written (a file in the way, no permission, or existing results)."""


def _temp_prefix(path: Path) -> str:
    return f".{path.name}."


def remove_stale_temps(path: str | os.PathLike) -> list[Path]:
    """Delete temporary files that interrupted writes of ``path`` left behind (their writing
    process is gone, e.g. killed with SIGKILL); files of live writers are kept."""
    path = Path(path)
    removed = []
    for tmp in path.parent.glob(f"{_temp_prefix(path)}*.tmp") if path.parent.is_dir() else ():
        if is_stale_temp(tmp):
            _remove(tmp)
            removed.append(tmp)
    return removed


def is_stale_temp(path: Path) -> bool:
    """Whether ``path`` is a temporary file or folder of `atomic_write`/`atomic_dir`
    (``.NAME.PID.*.tmp``) whose writing process is gone."""
    name = path.name
    if not (name.startswith(".") and name.endswith(".tmp")):
        return False
    parts = name[1:].split(".")
    pids = [int(p) for p in parts[1:-1] if p.isdigit()]
    return bool(pids) and not _alive(pids[0])


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def clear_stale_temps(folder: Path) -> None:
    """Delete what killed writers left in ``folder`` (`is_stale_temp`): never a reason to refuse it."""
    for entry in folder.iterdir():
        if is_stale_temp(entry):
            _remove(entry)


OUTPUT_MARKER = ".hydra-ens-output"
"""The file that marks a folder a command replaces as a whole (``finetune``'s, ``export``'s) as
written by hydra-ens: ``--overwrite`` replaces such a folder, never one of the user's own."""


def atomic_dir(path: str | os.PathLike, write: Callable[[Path], None], marker: bool = False) -> Path:
    """Call ``write(tmp)`` on a temporary directory beside ``path``, then rename it to ``path``:
    ``path`` is either the old directory or the complete new one, never half written, and the
    old one is deleted only once the new one is in place. Where the old one cannot be moved (a
    mount point), nothing is deleted: OutputError says where the new result is. Leftovers of a
    killed writer go at the next call. ``marker``: the new folder holds `OUTPUT_MARKER`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(path)
    prefix = f"{_temp_prefix(path)}{os.getpid()}."
    tmp = Path(tempfile.mkdtemp(prefix=prefix, suffix=".tmp", dir=path.parent))
    try:
        if marker:
            (tmp / OUTPUT_MARKER).write_text(
                "A folder written by hydra-ens: --overwrite replaces it whole.\n"
            )
        write(tmp)
        os.chmod(tmp, 0o777 & ~_umask())
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        _raise_write_error(exc, path)
        raise
    return replace_dir(path, tmp)


RUN_MARKER = ".hydra-ens-run"
"""The file in a folder a resumable command writes step by step (``build``'s output, its
``--overwrite`` staging folder) that names the settings of the run writing it (`claim_run_dir`)."""
_MARKER_BYTES = 4096


@contextlib.contextmanager
def claim_run_dir(
    path: str | os.PathLike, key: str, owned: tuple[str, ...], *, restart: bool = False, beside: bool = False
) -> Iterator[Path]:
    """Claim the folder ``path`` for the run whose settings digest is ``key`` (recorded in
    `RUN_MARKER`): a rerun of the same run resumes what is there. Entries ``owned`` that another
    run left (other settings, or a killed run that recorded none) never survive into the result:
    with ``restart`` they are removed first, else OutputError. Nothing is created or followed
    through a symbolic link: a link among ``owned`` is refused. ``beside``: ``path`` is a folder
    the library names beside an output (a staging folder), created here without following a link
    (`os.mkdir`), and anything already at that name that the library did not make (a link, a
    file, a FIFO, a folder without `RUN_MARKER`) is refused in one line, never written through
    or deleted. A run that ends in an exception before writing anything there leaves no folder
    it created."""
    path = Path(path)
    fresh = not os.path.lexists(path)
    made = _make_beside(path) if beside else False
    if not beside:
        path.mkdir(parents=True, exist_ok=True)
    recorded = None if made else _read_marker(path / RUN_MARKER, beside)
    entries = [path / name for name in owned if os.path.lexists(path / name)]
    for entry in entries:
        check_own_tree(entry)
    if recorded != key and entries:
        if not restart:
            raise OutputError(
                f"{path} holds what a run with other options left ({', '.join(e.name for e in entries)}): "
                "rerun with the same options to resume it, or pass --overwrite to start afresh"
            )
        for entry in entries:
            _remove(entry)
    if recorded != key:
        atomic_write_text(path / RUN_MARKER, key + "\n")
    try:
        yield path
    except BaseException:
        if fresh and {p.name for p in path.iterdir()} <= {RUN_MARKER}:
            shutil.rmtree(path, ignore_errors=True)
        raise


def check_own_tree(path: str | os.PathLike) -> Path:
    """``path`` and everything under it, links not followed, hold only real folders and regular
    files, as hydra-ens writes them: OutputError in one line naming the first symbolic link,
    FIFO, socket or device found, before anything there is read back, kept or removed (whoever
    can write into an output must not decide, through a link, what a later run reads or
    publishes from it)."""
    path = _check_own_entry(Path(path))
    for top, folders, files in os.walk(path, followlinks=False):  # nothing where path is a file
        for name in [*folders, *files]:
            _check_own_entry(Path(top) / name)
    return path


def _check_own_entry(entry: Path) -> Path:
    try:
        mode = os.lstat(entry).st_mode
    except FileNotFoundError:
        return entry
    if stat.S_ISLNK(mode):
        raise OutputError(
            f"{entry} is a symbolic link, not a folder hydra-ens made: remove it (it may have been "
            "planted to make this command read or write elsewhere)"
        )
    if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
        raise OutputError(f"{entry} is a FIFO, socket or device, not a file hydra-ens wrote: remove it")
    return entry


def recorded_run(path: str | os.PathLike) -> str | None:
    """The settings key `RUN_MARKER` records in the folder ``path`` (None where there is no
    folder or no marker; OutputError where the marker is not one hydra-ens writes)."""
    path = Path(path)
    if path.is_symlink() or not path.is_dir():
        return None
    return _read_marker(path / RUN_MARKER, False)


def check_beside(path: str | os.PathLike) -> Path:
    """``path``, a folder the library names beside an output (a checkpoint, a staging folder),
    where nothing is yet or a real folder is: OutputError in one line for a symbolic link, a
    file, a FIFO or anything else at that name, which is never written through or deleted."""
    path = Path(path)
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return path
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        what = "a symbolic link" if stat.S_ISLNK(info.st_mode) else "a file, a FIFO or a device"
        raise OutputError(
            f"{path} is {what}, not a folder hydra-ens made: remove it (hydra-ens writes there and "
            "never through what it did not make)"
        )
    return path


def _make_beside(path: Path) -> bool:
    """Create the folder ``path`` without following a link (True), or find a real folder there
    (False); OutputError for anything else at that name (`check_beside`)."""
    try:
        os.mkdir(path)
        return True
    except FileExistsError:
        check_beside(path)
        return False
    except OSError as exc:
        raise OutputError(f"cannot create {path}: {exc.strerror or exc}") from None


def _read_marker(marker: Path, required: bool) -> str | None:
    """The key `RUN_MARKER` records (None where there is none: a run that recorded nothing);
    OutputError where it is not a regular file, or is missing and ``required``."""
    try:
        info = os.lstat(marker)
    except FileNotFoundError:
        if required:
            raise OutputError(
                f"{marker.parent} holds no {RUN_MARKER}: it is not a folder hydra-ens made: remove it"
            ) from None
        return None
    if not stat.S_ISREG(info.st_mode) or info.st_size > _MARKER_BYTES:
        raise OutputError(f"{marker} is not the marker hydra-ens writes (a small regular file): remove it")
    return marker.read_text(encoding="utf-8", errors="replace").strip()


def replace_dir(path: Path, new: Path) -> Path:
    """Rename the complete folder ``new`` to ``path``: ``path`` is the old folder or the new one,
    never a mix; the old one is deleted only once the new one is in place, and where it cannot be
    moved (a mount point) nothing is deleted: OutputError says where the new result is."""
    old = None
    if path.exists() or path.is_symlink():
        prefix = f"{_temp_prefix(path)}{os.getpid()}."
        old = Path(tempfile.mkdtemp(prefix=prefix, suffix=".old.tmp", dir=path.parent))
        try:
            os.replace(path, old / path.name)
        except OSError as exc:
            shutil.rmtree(old, ignore_errors=True)
            raise OutputError(
                f"cannot replace {path} ({exc.strerror or exc}); it is unchanged and the new result is "
                f"in {new}: move it into place yourself"
            ) from None
    os.replace(new, path)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
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
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        _raise_write_error(exc, path)
        raise
    return path


def _raise_write_error(exc: BaseException, path: Path) -> None:
    """OutputError in one line naming ``path`` (not the temporary) where a write failed for want
    of space, or in safetensors' own error type (which a full disk also gives); the caller has
    removed its temporaries, so nothing is left behind."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        raise OutputError(
            f"cannot write {path}: no space left on the device ({exc.strerror}); nothing was written"
        ) from exc
    if type(exc).__name__ == "SafetensorError":
        raise OutputError(f"cannot write {path}: {' '.join(str(exc).split())}; nothing was written") from exc


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def atomic_write_json(path: str | os.PathLike, data: Any) -> Path:
    return atomic_write_text(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")
"""What a spreadsheet reads as the start of a formula in a CSV cell (the usual CSV-injection rule)."""


def spreadsheet_safe(value: Any) -> Any:
    """A text cell that a spreadsheet would run as a formula, prefixed with ``'`` (shown as text,
    the quote hidden); a list (a prediction set) as its items joined by ``|``; numbers and every
    other value unchanged."""
    if isinstance(value, list):
        value = "|".join(map(str, value))
    return "'" + value if isinstance(value, str) and value.startswith(FORMULA_STARTS) else value


def atomic_write_records(path: str | os.PathLike, rows: list[dict[str, Any]]) -> Path:
    """``rows`` (dicts with the same keys) as a table: JSON Lines for a ``.jsonl`` path (values as
    they are), else CSV with the first row's keys as header, text cells that begin like a
    formula prefixed with ``'`` (`spreadsheet_safe`); written atomically."""
    if Path(path).suffix == ".jsonl":
        return atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    import csv
    import io

    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(rows[0]) if rows else [])
    writer.writeheader()
    writer.writerows({k: spreadsheet_safe(v) for k, v in row.items()} for row in rows)
    return atomic_write_text(path, buffer.getvalue())


def save_file_set(
    folder: str | os.PathLike, files: dict[str, Callable[[Path], None]], meta: dict[str, Any]
) -> Path:
    """Write several files and ``meta`` as one unit (a checkpoint): a kill at any moment leaves
    either the previous set or the new one, complete, never a mix.

    Each file (``files`` maps a name such as ``model.safetensors`` to its writer) is written
    atomically under a generation-numbered name (``model.3.safetensors``); then the manifest
    (``MANIFEST``: ``meta``, each file's name and SHA-256) replaces the old one atomically, and
    only then are the previous generation's files removed. `load_file_set` reads the set back.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    manifest = folder / MANIFEST
    previous = _read_manifest(manifest) if manifest.is_file() else {}
    generation = int(previous.get("generation", 0)) + 1
    written = {}
    try:
        for name, write in files.items():
            stem, dot, suffix = name.partition(".")
            target = folder / f"{stem}.{generation}{dot}{suffix}"
            atomic_write(target, write)
            written[name] = {"file": target.name, "sha256": sha256_file(target)}
        atomic_write_json(manifest, {**meta, "generation": generation, "files": written})
    except BaseException:  # unless the manifest naming the new set landed, its files go
        try:
            landed = _read_manifest(manifest).get("generation") == generation
        except (OSError, ValueError):
            landed = False
        if not landed:
            for entry in written.values():
                (folder / entry["file"]).unlink(missing_ok=True)
        raise
    _remove_other_generations(folder, {*files, *previous.get("files", {})}, written)
    return manifest


def _remove_other_generations(folder: Path, names: set[str], current: dict[str, dict]) -> None:
    """Remove every generation of the files ``names`` that ``current`` does not name: the
    previous set, or what a writer killed before its manifest left."""
    keep = {entry["file"] for entry in current.values()}
    for name in sorted(names):
        stem, dot, suffix = name.partition(".")
        for old in sorted(folder.glob(f"{stem}.*{dot}{suffix}")):
            middle = old.name[len(stem) + 1 : len(old.name) - len(dot + suffix)]
            if middle.isdigit() and old.name not in keep:
                old.unlink(missing_ok=True)


MANIFEST = "manifest.json"
"""The file of a `save_file_set` folder that names its current files."""


def _read_manifest(manifest: Path) -> dict[str, Any]:
    data = read_json(manifest, "manifest")
    if not isinstance(data, dict) or not isinstance(data.get("files"), dict):
        raise InputError(f"{manifest} is not a manifest of saved files")
    return data


def load_file_set(folder: str | os.PathLike) -> tuple[dict[str, Any], dict[str, Path]] | None:
    """The manifest and the files of a `save_file_set` folder, each checked against its SHA-256;
    None where the folder holds no manifest (nothing saved yet). ValueError naming the file where
    one is missing or differs from what was saved. Files of other generations (left by a writer
    killed before or after its manifest) are removed."""
    folder = Path(folder)
    manifest = folder / MANIFEST
    if not manifest.is_file():
        return None
    data = _read_manifest(manifest)
    paths = {}
    for name, entry in data["files"].items():
        path = folder / str(entry.get("file", ""))
        if not path.is_file() or path.parent != folder:
            raise InputError(f"{path} named by {manifest} is missing")
        if sha256_file(path) != entry.get("sha256"):
            raise InputError(f"{path} differs from what was saved (SHA-256 mismatch)")
        paths[name] = path
    _remove_other_generations(folder, set(paths), data["files"])
    meta = {k: v for k, v in data.items() if k not in ("files", "generation")}
    return meta, paths


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


JSON_BYTES = 256 << 20
"""The largest JSON file the library reads (a calibration with its scores is a few MB)."""


def read_json(path: str | os.PathLike, what: str = "JSON file") -> Any:
    """A JSON file's content; InputError naming the file where it is missing, not a regular file
    (a FIFO or a device would block the reader), larger than `JSON_BYTES`, or not JSON."""
    path = Path(path)
    try:
        info = path.stat()
        if stat.S_ISDIR(info.st_mode):
            raise InputError(f"{what} {path} is a directory, not a file")
        if not stat.S_ISREG(info.st_mode):
            raise InputError(f"{what} {path} is not a regular file")
        if info.st_size > JSON_BYTES:
            raise InputError(f"{what} {path} is {info.st_size} bytes, more than any this library writes")
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError(f"{what} {path} does not exist") from None
    except IsADirectoryError:
        raise InputError(f"{what} {path} is a directory, not a file") from None
    except UnicodeDecodeError:
        raise InputError(f"{what} {path} is not UTF-8 text") from None
    except json.JSONDecodeError as exc:
        raise InputError(f"{what} {path} is not valid JSON (line {exc.lineno}: {exc.msg})") from None
    except OSError as exc:  # unreadable (permissions, I/O): a refusal naming the file
        raise InputError(f"{what} {path} cannot be read ({exc.strerror or exc})") from None


def probe_writable(folder: Path) -> None:
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


def check_writable_dir(path: str | os.PathLike) -> Path:
    """Check, before any work, that ``path`` can be written as a folder (not a file; writable);
    what killed writers left in it is removed."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise OutputError(f"output {path} is a file; name a directory")
    probe_writable(path)
    if path.is_dir():
        clear_stale_temps(path)
    return path


def check_replaceable_dir(path: str | os.PathLike, advice: str = "choose another output folder") -> Path:
    """Check, before any work, that ``path`` can be written as a folder that replaces any folder
    there as a whole (`atomic_dir`): not a file, not a mount point, and holding nothing unless
    hydra-ens wrote it (`OUTPUT_MARKER`): the user's own files are never deleted. ``advice`` ends
    the refusal (the command line names its options)."""
    path = Path(path)
    if os.path.ismount(path):
        raise OutputError(f"output {path} is a mount point, which cannot be replaced: name a folder in it")
    if not check_writable_dir(path).is_dir():
        return path
    if any(path.iterdir()) and not (path / OUTPUT_MARKER).is_file():
        raise OutputError(
            f"{path} holds files hydra-ens did not write, which replacing it would delete: {advice}"
        )
    return path
