"""The local cookie: credentials a fleet on one host needs no one to set.

A router and instances that all live on one machine, on loopback, still need
a shared token (the router signs the peers it names, instances sign their
registrations) and the P2P plane still needs a secret, or every other user
of the machine could register, sign grants or speak P2P. As Erlang's
distribution cookie does, the first process of a user creates a random
secret in a file only that user can read, and the same user's other
processes on that host read it there. Another user cannot read the file, so
cannot produce a single valid MAC.

Where: ``$XDG_RUNTIME_DIR/vllm-disagg/cookie`` when ``XDG_RUNTIME_DIR`` is
set and private (an absolute path to a directory owned by this user with no
group or other permissions, as systemd's ``/run/user/UID`` is), else
``~/.cache/vllm-disagg/cookie``. The file is ``0600`` and the directory
is created ``0700``, both owned by this user; anything else (a symlink,
another owner, a file with any group or other permission bit, a directory
that group or others may write to, a file that is not 64 hex digits) is
refused with one line naming the path and the fix, never repaired or
overwritten. A directory others may only read or enter is accepted, as ssh
accepts ``~/.ssh``: they cannot read the file, nor replace it; and the
directory under ``~/.cache`` may be shared with another tool's cache, which
may have made it ``0755`` first.

The file is created with ``O_CREAT | O_EXCL``: of processes that start at
once exactly one creates it, the others read what it wrote (waiting up to
:data:`READ_WAIT_S` for the 65 bytes). The cookie itself is never used as a
key: each use gets its own key derived from it (:meth:`Cookie.key`), so a
router token derived from it says nothing about the P2P secret.

Who uses it (the callers decide, this module only finds the file): the
router when no token is given, the connector when no router token / P2P
secret is set and everything it talks to is on loopback. Beyond loopback
nothing here applies. Standard library only.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path

# Under XDG_RUNTIME_DIR or ~/.cache: the directory and the file (0600).
COOKIE_RELPATH = "vllm-disagg/cookie"
DIR_NAME, FILE_NAME = COOKIE_RELPATH.split("/")
COOKIE_HEX_CHARS = 64  # 32 random bytes, hex, then a newline
# A reader that finds the file before its creator wrote it waits this long.
READ_WAIT_S = 2.0
MAX_COOKIE_FILE_BYTES = 4096

# What each key derived from the cookie is for (one key per use).
ROUTER_TOKEN = "router-token"
P2P_SECRET = "p2p-secret"


class CookieError(ValueError):
    """The cookie's file or directory cannot be trusted or used (one line,
    naming the path and what to do)."""


@dataclass(frozen=True)
class Cookie:
    path: Path
    value: bytes = field(repr=False)
    created: bool  # this process created the file

    def key(self, purpose: str) -> bytes:
        """The key for one use (:data:`ROUTER_TOKEN`, :data:`P2P_SECRET`), as
        64 hex digits: HMAC-SHA256 of the purpose under the cookie."""
        mac = hmac.new(
            self.value, f"vllm-disagg-cookie|{purpose}".encode(), hashlib.sha256
        )
        return mac.hexdigest().encode()

    def describe(self) -> str:
        """Where the key came from, for a log line (never the value)."""
        return f"the local cookie {self.path} ({'created' if self.created else 'read'})"


def _is_private_dir(path: str) -> bool:
    try:
        st = os.stat(path)
    except OSError:
        return False
    return (
        stat.S_ISDIR(st.st_mode)
        and st.st_uid == os.geteuid()
        and st.st_mode & 0o077 == 0
    )


def cookie_dir() -> Path:
    """The directory the cookie lives in (see the module docstring)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isabs(runtime) and _is_private_dir(runtime):
        return Path(runtime) / DIR_NAME
    try:
        home = Path.home()
    except (RuntimeError, KeyError):
        raise CookieError(
            "local cookie: no private XDG_RUNTIME_DIR and no home directory to "
            f"keep it in (~/.cache/{DIR_NAME}/{FILE_NAME})"
        ) from None
    return home / ".cache" / DIR_NAME


def cookie_path() -> Path:
    return cookie_dir() / FILE_NAME


def _refuse_unless_private(st: os.stat_result, path: Path, kind: str) -> None:
    """One line when ``st`` (of ``path``, a ``kind``: "directory"/"file") is
    not this user's: a file only this user may read or write, a directory
    only this user may write to."""
    is_dir = kind == "directory"
    if not (stat.S_ISDIR if is_dir else stat.S_ISREG)(st.st_mode):
        raise CookieError(f"local cookie: {path} is not a {kind}; remove it")
    if st.st_uid != os.geteuid():
        raise CookieError(
            f"local cookie: {kind} {path} is owned by uid {st.st_uid}, not by this "
            f"user (uid {os.geteuid()}); remove it"
        )
    mode = stat.S_IMODE(st.st_mode)
    if is_dir and mode & 0o022:
        raise CookieError(
            f"local cookie: directory {path} has mode {mode:04o}, writable by other "
            f"users; it must not be (chmod go-w {path})"
        )
    if not is_dir and mode & 0o077:
        raise CookieError(
            f"local cookie: file {path} has mode {mode:04o}, open to other users; "
            f"it must be 0600 (chmod 600 {path})"
        )


def _open_dir(directory: Path) -> int:
    """The directory, created 0700 if missing, opened without following a
    symlink and checked on the open descriptor (no check-then-use race)."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(directory, 0o700)
    except FileExistsError:
        pass
    else:
        os.chmod(directory, 0o700)  # whatever the umask left
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as e:
        # ELOOP: a symlink; ENOTDIR: a file.
        raise CookieError(
            f"local cookie: cannot open directory {directory} ({e.strerror}); it "
            "must be a directory of this user, not a symlink"
        ) from None
    try:
        _refuse_unless_private(os.fstat(fd), directory, "directory")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _read(fd: int, path: Path) -> bytes | None:
    """The cookie in the open file, None while it is still shorter than one."""
    _refuse_unless_private(os.fstat(fd), path, "file")
    data = os.pread(fd, MAX_COOKIE_FILE_BYTES, 0).strip()
    if len(data) < COOKIE_HEX_CHARS and all(c in b"0123456789abcdef" for c in data):
        return None
    if len(data) != COOKIE_HEX_CHARS or any(c not in b"0123456789abcdef" for c in data):
        raise CookieError(
            f"local cookie: {path} does not hold a cookie ({COOKIE_HEX_CHARS} hex "
            "digits); remove it (the next process creates a new one)"
        )
    return data


def _read_existing(dir_fd: int, path: Path) -> bytes:
    deadline = time.monotonic() + READ_WAIT_S
    while True:
        try:
            fd = os.open(FILE_NAME, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=dir_fd)
        except OSError as e:
            raise CookieError(
                f"local cookie: cannot read {path} ({e.strerror}); it must be a file "
                "of this user, mode 0600, not a symlink"
            ) from None
        try:
            value = _read(fd, path)
        finally:
            os.close(fd)
        if value is not None:
            return value
        if time.monotonic() > deadline:  # its creator died before writing it
            raise CookieError(
                f"local cookie: {path} is empty or incomplete; remove it (the next "
                "process creates a new one)"
            )
        time.sleep(0.01)


def load_cookie(directory: Path | None = None) -> Cookie:
    """This user's cookie, created if there is none yet. Raises
    :class:`CookieError` (one line) when the file or its directory is not
    this user's alone, or cannot be made."""
    directory = cookie_dir() if directory is None else Path(directory)
    path = directory / FILE_NAME
    try:
        dir_fd = _open_dir(directory)
    except OSError as e:
        raise CookieError(
            f"local cookie: cannot create {directory} ({e.strerror})"
        ) from None
    try:
        try:
            fd = os.open(
                FILE_NAME,
                os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW,
                0o600,
                dir_fd=dir_fd,
            )
        except FileExistsError:
            return Cookie(path, _read_existing(dir_fd, path), created=False)
        except OSError as e:
            raise CookieError(
                f"local cookie: cannot create {path} ({e.strerror})"
            ) from None
        value = secrets.token_hex(COOKIE_HEX_CHARS // 2).encode()
        try:
            os.fchmod(fd, 0o600)
            os.write(fd, value + b"\n")
            os.fsync(fd)
        finally:
            os.close(fd)
        return Cookie(path, value, created=True)
    finally:
        os.close(dir_fd)
