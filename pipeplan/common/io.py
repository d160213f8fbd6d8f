"""Writes that never destroy: files appear complete or not at all, folders are swapped in as a whole.

- `atomic_write_*` write a temporary file beside PATH and rename it over PATH; they refuse a PATH that
  exists and is not a regular file (a symlink, a device node, a folder, a fifo), so an `--out` that names
  `/dev/sda` or a link is never replaced.
- `staged_output` builds a command's whole output folder privately, then swaps it in: the old folder is
  renamed aside, the new one into place, and only then is the old one deleted. A failure at any point
  leaves the old folder exactly as it was. Each folder carries a manifest (`pipeplan.json`: command,
  scenario, version) saying whose outputs it holds; a folder of another command's outputs (or of files
  pipeplan did not write) is refused unless `force`.
- A staging folder left by a killed process (`.<out>.staging-<pid>-*`) is deleted by the next run.

This module imports nothing from the project, so sim/, lcp/ and analysis/ can all use it; its errors are
`OutputError`s, which the CLI reports as one line with exit code 2.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import math
import os
import shutil
import socket
import stat
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

MANIFEST = "pipeplan.json"
"""Written into every output folder: which command, scenario and pipeplan version wrote it."""
FORBIDDEN_ROOTS = ("/proc", "/sys", "/dev")
"""Kernel and device file systems: never an output location (but /dev/shm, a plain tmpfs, is)."""
ALLOWED_UNDER_FORBIDDEN = ("/dev/shm",)
LEGACY_STAGING_AGE_S = 24 * 3600
"""A staging folder whose owner cannot be told (no pid in its name) is stale after a day."""


class OutputError(Exception):
    """An output that cannot be written without destroying something, or with invalid content."""


class OutputPathError(OutputError):
    """An output path that is empty, not a regular file (or folder), on /proc, or holds others' outputs."""


class OutputValueError(OutputError):
    """Content that has no valid encoding, e.g. a non-finite number in strict JSON."""


class InputError(Exception):
    """An input file that is missing, not a regular file (a fifo would block its reader forever), or too large."""


def check_output_file(path: str | Path, flag: str = "--out") -> Path:
    """`path` as a Path if a file may be (re)written there; OutputPathError naming the problem if not."""
    return _check_output(path, flag, "file", "regular file")


def check_output_folder(path: str | Path, flag: str = "--out") -> Path:
    """`path` as a Path if an output folder may be written there (absent, or an existing real folder), and be
    replaced as a whole: not the current folder or a root (a rename of either fails with "Device or resource
    busy" after all the work), in a parent folder this process may write (not read-only, not immutable)."""
    p = _check_output(path, flag, "folder", "folder")
    full = Path(os.path.abspath(p))
    if full == Path.cwd() or full.parent == full or p.name in ("", ".", ".."):
        raise OutputPathError(f"{flag} {short_path(p)}: is the current folder or a root, which cannot be replaced "
                              "as a whole; give a subfolder, e.g. out/run")
    parent = next((q for q in full.parents if q.exists()), None)
    for folder in (parent, full if full.is_dir() else None):
        if folder is not None and not os.access(folder, os.W_OK | os.X_OK):
            raise OutputPathError(f"{flag} {short_path(p)}: {short_path(folder)} cannot be written here (read-only "
                                  "or immutable); write elsewhere")
    return p


def _check_output(path: str | Path, flag: str, kind_wanted: str, noun: str) -> Path:
    p = _nonempty(path, flag)
    kind = _existing_kind(p)
    if kind not in (None, kind_wanted):
        raise OutputPathError(f"{flag} {short_path(p)}: is a {kind}, not a {noun}; give a {kind_wanted} path")
    return _checked_path(p, flag)


def _nonempty(path: str | Path, flag: str) -> Path:
    if not str(path).strip():  # Path("") is ".": the current folder, never what was meant
        raise OutputPathError(f"{flag}: empty path; give a file or folder name")
    return Path(path)


def _checked_path(p: Path, flag: str) -> Path:
    """Not on /proc, /sys or /dev (but /dev/shm), and no file where a parent folder should be."""
    parent = p.absolute().parent
    resolved = str((parent.resolve() if parent.exists() else Path(os.path.abspath(parent))) / p.name)
    def under(root: str) -> bool:
        return resolved == root or resolved.startswith(root + "/")

    if any(map(under, FORBIDDEN_ROOTS)) and not any(map(under, ALLOWED_UNDER_FORBIDDEN)):
        raise OutputPathError(f"{flag} {short_path(p)}: lies on a kernel or device file system; write elsewhere")
    for parent in p.absolute().parents:
        kind = _existing_kind(parent)
        if kind is None or kind == "folder" or (kind == "symlink" and parent.is_dir()):
            continue
        raise OutputPathError(f"{flag} {short_path(p)}: {short_path(parent)} is a {kind}, not a folder")
    return p


def _existing_kind(p: Path) -> str | None:
    """None if nothing is at p; else 'file', 'folder', 'symlink', 'device', 'fifo', 'socket'."""
    try:
        mode = p.lstat().st_mode
    except FileNotFoundError:
        return None
    except NotADirectoryError:
        return "path under a file"
    return _kind_of(mode)


def _kind_of(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "symlink"
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "folder"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "device"
    return "fifo" if stat.S_ISFIFO(mode) else "socket"


def short_path(p: str | Path, limit: int = 80) -> str:
    """A path short enough for a one-line error: its end (the file name) kept, leading folders cut."""
    text = str(p)
    return text if len(text) <= limit else "..." + text[3 - limit :]  # keep the name, cut the folders


def read_input_bytes(path: str | Path, max_bytes: int, what: str, follow_links: bool = True) -> bytes:
    """The bytes of the regular file `path`, at most `max_bytes` of them; InputError naming `what` and the file
    otherwise. A fifo, device or folder is refused before it is opened (opening a fifo waits for a writer, forever),
    and the file is opened non-blocking and checked again, so one swapped in after the check cannot block either.
    With `follow_links=False` a symlink is refused too (a report must not read files outside its folder)."""
    if not str(path).strip():
        raise InputError(f"{what}: empty path; give a file")
    p = Path(path)
    shown = f"{what} {short_path(p)}"
    try:
        info = os.stat(p, follow_symlinks=follow_links)
        _check_regular(info, shown, max_bytes)
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow_links else os.O_NOFOLLOW))
    except FileNotFoundError:
        raise InputError(f"{shown}: file not found") from None
    except ValueError:  # a NUL byte in the path
        raise InputError(f"{what}: the path holds a NUL byte; give a file name") from None
    except OSError as exc:
        reason = "is a symlink; give the file itself" if exc.errno == errno.ELOOP else f"cannot read ({exc.strerror})"
        raise InputError(f"{shown}: {reason}") from None
    with os.fdopen(fd, "rb") as f:
        _check_regular(os.fstat(f.fileno()), shown, max_bytes)
        try:
            data = f.read(max_bytes + 1)
        except OSError as exc:
            raise InputError(f"{shown}: cannot read ({exc.strerror})") from None
    if len(data) > max_bytes:
        raise InputError(f"{shown}: larger than the limit of {max_bytes:,} bytes")
    return data


def _check_regular(info: os.stat_result, shown: str, max_bytes: int) -> None:
    if not stat.S_ISREG(info.st_mode):
        raise InputError(f"{shown}: is a {_kind_of(info.st_mode)}, not a regular file; give a file")
    if info.st_size > max_bytes:
        raise InputError(f"{shown}: {info.st_size:,} bytes, larger than the limit of {max_bytes:,}")


FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")
"""How a spreadsheet formula may begin: a CSV cell we write from a user's string never does (OWASP, "CSV
Injection": prefix such a cell with a single quote so it is shown as text)."""


def formula_safe(value: Any) -> Any:
    """`value`, with a leading single quote if it is a string a spreadsheet would run as a formula; numbers
    written as text ("-1.5") are left alone."""
    if not isinstance(value, str) or not value.startswith(FORMULA_STARTS):
        return value
    try:
        float(value)
        return value
    except ValueError:
        return "'" + value


def csv_text(df: Any) -> str:
    """A pandas DataFrame as CSV text (no index), with formula_safe applied to every text cell and header."""
    safe = df.rename(columns=formula_safe)
    for col in safe.select_dtypes(include=["object", "string"]).columns:
        safe[col] = safe[col].map(formula_safe)
    return str(safe.to_csv(index=False))


@contextmanager
def atomic_file(path: str | Path) -> Iterator[IO[bytes]]:
    """A binary file to write `path`'s new content into: a temporary created exclusively (mkstemp: a unique name,
    O_EXCL, so never a planted link followed) in the same folder, renamed over `path` when the block ends without
    error, deleted otherwise. Matplotlib's savefig and torch.save write to it as to any file object."""
    path = check_output_file(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; outputs get the usual permissions
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        check_output_file(path)  # what appeared at path while we wrote is not ours to replace either
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write `data` to `path` through a temporary file in the same folder and an atomic rename."""
    with atomic_file(path) as f:
        f.write(data)


def append_fsynced(path: str | Path, data: bytes, first: bytes = b"") -> None:
    """Append `data` to the regular file `path` in one `write` on an O_APPEND descriptor, then fsync: records
    from several processes never interleave and a crash tears at most the last. `first` goes before `data` when
    the file is new or empty (a CSV header); after a torn last line, a newline does, so `data` starts a line."""
    fd = os.open(check_output_file(path), os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            data = first + data
        elif os.pread(fd, 1, size - 1) != b"\n":
            data = b"\n" + data
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


LOCK_SUFFIX = ".lock"


@contextmanager
def output_lock(out: str | Path, command: str, flag: str = "--out") -> Iterator[None]:
    """Hold `.<out>.lock` beside `out` (its pid and host inside) while a command writes there; OutputPathError
    naming the holder if another process holds it. Two sweeps on one folder appended every row twice. The lock
    is an flock, so a killed holder releases it; it lives in the parent, so a folder swapped in keeps it. Where the
    parent does not exist yet, nobody can be writing there and nothing is locked."""
    full = Path(os.path.abspath(out))
    lock = full.parent / f".{full.name}{LOCK_SUFFIX}"
    if not full.parent.is_dir():
        yield
        return
    while True:
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError:  # a read-only parent, a link planted there: check_output_folder names the problem
            yield
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise OutputPathError(f"{flag} {short_path(out)}: in use by {holder}; wait for it to finish or choose "
                                  "another folder") from None
        try:
            same = os.fstat(fd).st_ino == os.stat(lock, follow_symlinks=False).st_ino
        except OSError:
            same = False
        if same:  # not a file another holder unlinked between our open and our flock
            break
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pipeplan {command} (pid {os.getpid()} on {socket.gethostname()})\n".encode(), 0)
        yield
    finally:
        with contextlib.suppress(OSError):
            os.unlink(lock)
        os.close(fd)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def strict_json(obj: Any) -> str:
    """JSON text as RFC 8259 defines it: a NaN or an infinity is an error, never `NaN`/`Infinity` tokens."""
    try:
        return json.dumps(obj, indent=2, sort_keys=False, allow_nan=False) + "\n"
    except ValueError:
        where = _non_finite_key(obj)
        raise OutputValueError(
            f"result {where or 'value'} is not a finite number; inputs this large or small cannot be simulated"
        ) from None


def _non_finite_key(obj: Any, prefix: str = "") -> str | None:
    if isinstance(obj, float) and not math.isfinite(obj):
        return prefix or None
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list | tuple) else ()
    for k, v in items:
        found = _non_finite_key(v, f"{prefix}.{k}" if prefix else str(k))
        if found:
            return found
    return None


def atomic_write_json(path: str | Path, obj: Any) -> None:
    atomic_write_text(path, strict_json(obj))


def output_manifest(path: str | Path) -> dict[str, Any] | None:
    """The manifest of an output folder, or None if it has none (or an unreadable one)."""
    try:
        data = json.loads((Path(path) / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def check_folder_owner(out: Path, command: str, force: bool, flag: str = "--out") -> None:
    """Refuse to replace a folder that holds files of another command, or files pipeplan did not write.

    An absent or empty folder, or one written by the same `command`, is replaced; `force` replaces any.
    """
    if force or _existing_kind(out) != "folder" or not any(out.iterdir()):
        return
    owner = output_manifest(out)
    if owner is None:
        raise OutputPathError(
            f"{flag} {short_path(out)}: holds files pipeplan did not write (no {MANIFEST}); choose an empty or new "
            "folder, or pass --force to replace it"
        )
    if owner.get("command") != command:
        raise OutputPathError(
            f"{flag} {short_path(out)}: holds the outputs of `pipeplan {short_path(str(owner.get('command')), 40)}`; "
            "choose another folder, or pass --force to replace it"
        )


def check_file_owner(path: Path, signature: bytes, what: str, force: bool, flag: str = "--out") -> None:
    """Refuse to replace an existing, non-empty regular file that does not start with `signature` (how the
    file pipeplan writes there begins: an LCP index's magic, a CSV's header line), unless `force`.

    A file output is replaced atomically, which makes replacing someone's unrelated file just as final; an
    absent or empty file, or one of the kind the command writes, is replaced as before."""
    if force or _existing_kind(path) != "file":
        return
    try:
        with path.open("rb") as f:
            head = f.read(len(signature))
    except OSError:
        head = b"?"  # unreadable: certainly not one of ours
    if head and head != signature:
        raise OutputPathError(f"{flag} {short_path(path)}: exists and is not {what}; move it away or pass --force "
                              "to replace it")


def clean_stale_staging(out: Path) -> None:
    """Delete `.<out>.staging-*` and `.<out>.old-*` folders whose process has died (or, if unnamed, old)."""
    parent = out.absolute().parent
    if not parent.is_dir():
        return
    for kind in ("staging", "old"):
        for stale in parent.glob(f".{out.name}.{kind}-*"):
            if _owner_alive(stale.name.removeprefix(f".{out.name}.{kind}-"), stale):
                continue
            shutil.rmtree(stale, ignore_errors=True)


def _owner_alive(suffix: str, folder: Path) -> bool:
    pid_text = suffix.split("-", 1)[0]
    if not pid_text.isdigit():  # made before staging names carried a pid
        try:
            return time.time() - folder.lstat().st_mtime < LEGACY_STAGING_AGE_S
        except OSError:
            return True
    pid = int(pid_text)
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


@contextmanager
def staged_output(
    out_dir: str | Path, manifest: dict[str, Any] | None = None, force: bool = False
) -> Iterator[Path]:
    """Yield a private staging folder; on success swap it in as `out_dir` (with `manifest` as pipeplan.json),
    on error discard it. Readers see the old folder or the new one, never a mix of the two.

    With a manifest whose "command" names the writer, a non-empty `out_dir` of another writer is refused
    (OutputPathError) unless `force`.
    """
    out = check_output_folder(out_dir)
    if manifest is not None:
        check_folder_owner(out, str(manifest.get("command")), force)
    parent = out.absolute().parent
    created = [p for p in (parent, *parent.parents) if not p.exists()]  # to remove again if we fail
    parent.mkdir(parents=True, exist_ok=True)
    clean_stale_staging(out)
    stage = Path(tempfile.mkdtemp(dir=parent, prefix=f".{out.name}.staging-{os.getpid()}-"))
    try:
        yield stage
        if manifest is not None:
            atomic_write_text(stage / MANIFEST, strict_json(manifest))
        os.chmod(stage, 0o777 & ~_umask())  # mkdtemp makes 0700; outputs get the usual permissions
        check_output_folder(out)  # again: something may have appeared there while we worked
        if manifest is not None:
            check_folder_owner(out, str(manifest.get("command")), force)
        _swap_in(stage, out)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        for p in created:  # innermost first; a folder someone else has filled meanwhile stays
            with contextlib.suppress(OSError):
                p.rmdir()
        raise
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def _swap_in(stage: Path, out: Path) -> None:
    """Rename the old folder aside, the staged one into place, then delete the old one; say which of the old
    folder's files the new one does not have (a user's own file there is not deleted without a word)."""
    if not out.exists():
        os.rename(stage, out)
        return
    gone = sorted(set(os.listdir(out)) - set(os.listdir(stage)))
    if gone:
        shown = ", ".join(short_path(name, 40) for name in gone[:5]) + (" ..." if len(gone) > 5 else "")
        print(f"warning: {short_path(out)} replaced as a whole; {len(gone)} file(s) this run did not write are "
              f"gone: {shown}", file=sys.stderr)
    aside = Path(tempfile.mkdtemp(dir=out.absolute().parent, prefix=f".{out.name}.old-{os.getpid()}-"))
    old = aside / "old"
    os.rename(out, old)
    try:
        os.rename(stage, out)
    except BaseException:
        os.rename(old, out)  # put the old folder back exactly as it was
        shutil.rmtree(aside, ignore_errors=True)
        raise
    shutil.rmtree(aside, ignore_errors=True)
    if aside.exists():  # an undeletable file in the old folder (immutable, another owner's): say where it stays
        print(f"warning: the previous {short_path(out)} could not be deleted completely; what is left is in "
              f"{short_path(aside)}", file=sys.stderr)
