"""The local cookie (vllm_disagg/wire/cookie.py): created once, the same for
every reader of one user, private, refused when it is not."""

from __future__ import annotations

import multiprocessing
import os
import stat
from pathlib import Path

import pytest

from vllm_disagg.wire import cookie as cookie_mod
from vllm_disagg.wire.cookie import (
    COOKIE_HEX_CHARS,
    DIR_NAME,
    FILE_NAME,
    P2P_SECRET,
    ROUTER_TOKEN,
    CookieError,
    cookie_dir,
    load_cookie,
)


@pytest.fixture
def runtime_dir(tmp_path, monkeypatch) -> Path:
    """A private XDG_RUNTIME_DIR, as systemd makes /run/user/UID."""
    path = tmp_path / "run"
    path.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(path))
    return path


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def _error(directory: Path) -> str:
    with pytest.raises(CookieError) as info:
        load_cookie(directory)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_created_once_then_read_with_the_same_value(runtime_dir):
    first = load_cookie()
    assert first.created and first.path == runtime_dir / DIR_NAME / FILE_NAME
    second = load_cookie()
    assert not second.created and second.value == first.value
    assert len(first.value) == COOKIE_HEX_CHARS
    assert first.path.read_bytes() == first.value + b"\n"
    assert _mode(first.path) == 0o600 and _mode(first.path.parent) == 0o700
    assert first.path.stat().st_uid == os.geteuid()


def test_created_private_whatever_the_umask(runtime_dir):
    old = os.umask(0)
    try:
        made = load_cookie()
    finally:
        os.umask(old)
    assert _mode(made.path) == 0o600 and _mode(made.path.parent) == 0o700


def test_derived_keys_are_per_purpose_and_never_the_cookie(runtime_dir):
    made = load_cookie()
    token, secret = made.key(ROUTER_TOKEN), made.key(P2P_SECRET)
    assert token != secret and made.value not in (token, secret)
    assert len(token) == 64 and token == load_cookie().key(ROUTER_TOKEN)
    assert made.value.decode() not in repr(made) + made.describe()
    assert str(made.path) in made.describe() and "created" in made.describe()


def test_an_xdg_runtime_dir_that_is_not_private_is_not_used(tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    os.chmod(shared, 0o755)
    for value in (str(shared), "relative/dir", str(tmp_path / "missing")):
        monkeypatch.setenv("XDG_RUNTIME_DIR", value)
        assert cookie_dir() == home / ".cache" / DIR_NAME
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    made = load_cookie()
    assert made.path == home / ".cache" / DIR_NAME / FILE_NAME
    assert _mode(made.path.parent) == 0o700


def test_a_directory_others_may_write_to_is_refused(tmp_path):
    directory = tmp_path / DIR_NAME
    directory.mkdir()
    for mode in (0o777, 0o720, 0o702):
        os.chmod(directory, mode)
        message = _error(directory)
        assert message == (
            f"local cookie: directory {directory} has mode {mode:04o}, writable by "
            f"other users; it must not be (chmod go-w {directory})"
        )
    assert not (directory / FILE_NAME).exists()


def test_a_directory_others_may_only_read_is_accepted(tmp_path):
    """As ssh accepts a 0755 ~/.ssh: others cannot read the 0600 file nor
    replace it. The directory under ~/.cache may also be another tool's
    cache, which may have made it 0755 first."""
    directory = tmp_path / DIR_NAME
    directory.mkdir()
    os.chmod(directory, 0o755)
    made = load_cookie(directory)
    assert made.created and _mode(made.path) == 0o600 and _mode(directory) == 0o755


def test_a_file_open_to_others_is_refused_not_repaired(tmp_path):
    made = load_cookie(tmp_path / DIR_NAME)
    os.chmod(made.path, 0o644)
    message = _error(made.path.parent)
    assert message == (
        f"local cookie: file {made.path} has mode 0644, open to other users; it "
        f"must be 0600 (chmod 600 {made.path})"
    )
    assert _mode(made.path) == 0o644
    os.chmod(made.path, 0o640)
    assert "mode 0640" in _error(made.path.parent)


def test_a_symlink_is_refused(tmp_path):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / DIR_NAME
    link.symlink_to(real)
    assert "not a symlink" in _error(link)
    directory = tmp_path / "d"
    directory.mkdir(mode=0o700)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_text("a" * COOKIE_HEX_CHARS)
    os.chmod(elsewhere, 0o600)
    (directory / FILE_NAME).symlink_to(elsewhere)
    assert "not a symlink" in _error(directory)


def test_someone_elses_directory_is_refused(tmp_path, monkeypatch):
    made = load_cookie(tmp_path / DIR_NAME)
    monkeypatch.setattr(cookie_mod.os, "geteuid", lambda: os.getuid() + 4242)
    message = _error(made.path.parent)
    assert message.startswith(f"local cookie: directory {made.path.parent} is owned")
    assert f"not by this user (uid {os.getuid() + 4242})" in message


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file away")
def test_a_file_of_another_user_is_refused(tmp_path):
    made = load_cookie(tmp_path / DIR_NAME)
    os.chown(made.path, 65534, 65534)
    assert _error(made.path.parent) == (
        f"local cookie: file {made.path} is owned by uid 65534, not by this user "
        "(uid 0); remove it"
    )


def test_a_file_that_is_no_cookie_is_refused(tmp_path, monkeypatch):
    directory = tmp_path / DIR_NAME
    directory.mkdir(mode=0o700)
    path = directory / FILE_NAME
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, b"not a cookie, but long enough to be read as a whole one, yes.....")
    os.close(fd)
    assert "does not hold a cookie" in _error(directory)
    path.write_bytes(b"")
    monkeypatch.setattr(cookie_mod, "READ_WAIT_S", 0.05)
    assert "is empty or incomplete; remove it" in _error(directory)
    path.unlink()
    path.mkdir(mode=0o700)
    assert _error(directory) == f"local cookie: {path} is not a file; remove it"


def _load_in_child(directory: str, queue) -> None:
    queue.put(load_cookie(Path(directory)))


def test_processes_starting_at_once_agree(tmp_path):
    """Of many processes that find no cookie, exactly one creates it and all
    use its value (O_EXCL, and readers wait for the creator's write)."""
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    directory = tmp_path / "fresh" / DIR_NAME  # the parent is missing too
    children = [
        ctx.Process(target=_load_in_child, args=(str(directory), queue))
        for _ in range(12)
    ]
    for child in children:
        child.start()
    results = [queue.get(timeout=30) for _ in children]
    for child in children:
        child.join(timeout=30)
        assert child.exitcode == 0
    assert sum(r.created for r in results) == 1
    assert len({r.value for r in results}) == 1
    assert _mode(directory / FILE_NAME) == 0o600 and _mode(directory) == 0o700
