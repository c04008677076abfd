"""The export's input: the pinned vLLM source, read and verified against the pin.

The source is an sdist (``--sdist``), a source tree (``--vllm-src``: an
extracted sdist or a git checkout), or, with neither, the pinned sdist in the
cache, downloaded with pip on first use. :func:`verify` refuses, with one line
naming what differs, unless the version, every pinned file and (for an sdist)
the sdist's sha256 match :mod:`vllm_disagg.export.pin`; :func:`check` reports
how another release's tree differs from the pin.
"""

from __future__ import annotations

import email.parser
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from vllm_disagg import envs
from vllm_disagg.errors import VllmDisaggError
from vllm_disagg.export import pin as pin_module
from vllm_disagg.export.pin import sha256_bytes, sha256_file


class ExportError(VllmDisaggError):
    """Bad input to the export: the message is the one line the user sees."""


@dataclass(frozen=True)
class Pin:
    version: str
    sdist_name: str
    sdist_sha256: str
    files: dict[str, str]

    @classmethod
    def current(cls) -> Pin:
        """The pin in :mod:`vllm_disagg.export.pin`, read at call time."""
        return cls(
            version=pin_module.VLLM_VERSION,
            sdist_name=pin_module.SDIST_NAME,
            sdist_sha256=pin_module.SDIST_SHA256,
            files=dict(pin_module.PINNED_FILES),
        )


@dataclass
class Source:
    """What the export read of its input."""

    path: Path
    kind: str  # "sdist" or "tree"
    version: str | None
    # Where the version was read from (PKG-INFO, vllm/_version.py, a git tag).
    version_from: str
    sdist_sha256: str | None = None
    # Relative path -> content, None where the source lacks the file.
    files: dict[str, bytes | None] = field(default_factory=dict)

    def describe(self) -> str:
        return f"{'sdist' if self.kind == 'sdist' else 'source tree'} {self.path}"


_VERSION_PY = re.compile(
    r"""^__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""", re.M
)
# Files every vLLM sdist and source tree has.
_MARKER = "vllm/__init__.py"


def read_source(path: Path, wanted: Iterable[str]) -> Source:
    """Read the version and the ``wanted`` files of an sdist or source tree."""
    path = Path(path)
    if path.is_dir():
        return _read_tree(path, wanted)
    if path.is_file():
        return _read_sdist(path, wanted)
    raise ExportError(f"{path}: no such file or directory")


def _read_tree(root: Path, wanted: Iterable[str]) -> Source:
    if not (root / _MARKER).is_file():
        raise ExportError(f"{root} is not a vLLM source tree (it has no {_MARKER})")
    files = {rel: _read_or_none(root / rel) for rel in wanted}
    pkg_info = _read_or_none(root / "PKG-INFO")
    version_py = _read_or_none(root / "vllm/_version.py")
    if pkg_info is not None:
        version, origin = _pkg_info_version(root, pkg_info), "PKG-INFO"
    elif version_py is not None:
        version, origin = _version_py(version_py), "vllm/_version.py"
    elif (root / ".git").exists():
        version, origin = _git_tag_version(root), "its git tag"
    else:
        version, origin = (
            None,
            "PKG-INFO, vllm/_version.py and .git: it has none of them",
        )
    return Source(root, "tree", version, origin, files=files)


def _read_or_none(path: Path) -> bytes | None:
    return path.read_bytes() if path.is_file() else None


def _read_sdist(path: Path, wanted: Iterable[str]) -> Source:
    wanted = set(wanted)
    needed = wanted | {"PKG-INFO", _MARKER}
    found: dict[tuple[str, str], bytes] = {}
    try:
        if not tarfile.is_tarfile(path):
            raise ExportError(f"{path} is not an sdist (not a tar archive)")
        with tarfile.open(path) as tar:
            for member in tar:
                name = member.name.removeprefix("./")
                top, _, rel = name.partition("/")
                if rel in needed and member.isfile():
                    found[(top, rel)] = tar.extractfile(member).read()
    except (tarfile.TarError, EOFError, OSError, zlib.error) as exc:
        raise ExportError(f"{path}: cannot read it as an sdist ({exc})") from None
    tops = sorted({top for top, rel in found if rel == "PKG-INFO"})
    if len(tops) != 1 or (tops[0], _MARKER) not in found:
        raise ExportError(
            f"{path} is not a vLLM sdist (it has no single <name>-<version>/ directory "
            f"with PKG-INFO and {_MARKER})"
        )
    top = tops[0]
    version = _pkg_info_version(path, found[(top, "PKG-INFO")])
    files = {rel: found.get((top, rel)) for rel in wanted}
    return Source(path, "sdist", version, "PKG-INFO", sha256_file(path), files)


def _pkg_info_version(where: Path, data: bytes) -> str | None:
    headers = email.parser.HeaderParser().parsestr(data.decode("utf-8", "replace"))
    name = (headers.get("Name") or "").strip()
    if name.lower().replace("_", "-") != "vllm":
        raise ExportError(
            f"{where} is the source of {name or 'an unnamed project'!r}, not vllm"
        )
    return (headers.get("Version") or "").strip() or None


def _version_py(data: bytes) -> str | None:
    match = _VERSION_PY.search(data.decode("utf-8", "replace"))
    return match.group(1) if match else None


def _git_tag_version(root: Path) -> str | None:
    git = shutil.which("git")
    if git is None:
        raise ExportError(
            "git is not installed: it is needed to read the version of the git "
            f"checkout {root} (which has no PKG-INFO or vllm/_version.py)"
        )
    out = subprocess.run(
        [git, "-C", str(root), "describe", "--tags", "--exact-match", "HEAD"],
        capture_output=True,
        text=True,
    )
    tag = out.stdout.strip()
    return tag.removeprefix("v") if out.returncode == 0 and tag else None


@dataclass(frozen=True)
class FileStatus:
    rel: str
    status: str  # "same", "differs" or "missing"


def compare_files(source: Source, pin: Pin) -> list[FileStatus]:
    """Each pinned file of ``source`` against the pin, in path order."""
    result = []
    for rel in sorted(pin.files):
        data = source.files.get(rel)
        if data is None:
            status = "missing"
        elif sha256_bytes(data) == pin.files[rel]:
            status = "same"
        else:
            status = "differs"
        result.append(FileStatus(rel, status))
    return result


def verify(source: Source, pin: Pin | None = None) -> list[str]:
    """Refuse (ExportError, one line) unless ``source`` is the pinned source;
    return the lines saying what was verified."""
    pin = pin or Pin.current()
    statuses = compare_files(source, pin)
    differ = [s.rel for s in statuses if s.status == "differs"]
    missing = [s.rel for s in statuses if s.status == "missing"]
    what = source.describe()
    if source.version is None:
        raise ExportError(
            f"{what}: cannot tell its vLLM version (tried {source.version_from})"
        )
    if source.version != pin.version:
        changed = len(differ) + len(missing)
        raise ExportError(
            f"{what} is vLLM {source.version} (from {source.version_from}), the pin is "
            f"vLLM {pin.version}; {changed} of {len(statuses)} pinned files differ "
            "(--check lists them)"
        )
    if differ or missing:
        parts = []
        if differ:
            parts.append(f"modified {', '.join(differ)}")
        if missing:
            parts.append(f"missing {', '.join(missing)}")
        raise ExportError(
            f"{what} is not the pinned vLLM {pin.version}: {'; '.join(parts)}"
        )
    if source.kind == "sdist" and source.sdist_sha256 != pin.sdist_sha256:
        raise ExportError(
            f"{what}: sha256 {source.sdist_sha256} is not the pinned "
            f"{pin.sdist_name}'s {pin.sdist_sha256} (its version and pinned files "
            "match)"
        )
    lines = [f"source: {what}"]
    if source.kind == "sdist":
        lines.append(f"sdist sha256: {source.sdist_sha256} (as pinned)")
    lines.append(
        f"version: vLLM {source.version} from {source.version_from} (as pinned)"
    )
    lines.append(f"pinned upstream files: all {len(statuses)} match their sha256:")
    lines += [f"  {s.rel}" for s in statuses]
    return lines


def check(path: Path, pin: Pin | None = None) -> list[str]:
    """The first part of the drift report: how the pinned files of another
    release's sdist or source tree differ from the pin (the rest is
    :mod:`vllm_disagg.export.drift`)."""
    pin = pin or Pin.current()
    source = read_source(path, pin.files)
    statuses = compare_files(source, pin)
    lines = [
        f"check: {source.describe()}, vLLM {source.version or 'of unknown version'} "
        f"(pin: vLLM {pin.version})"
    ]
    lines += [f"  {s.status:<8} {s.rel}" for s in statuses]
    counts = {
        k: sum(s.status == k for s in statuses) for k in ("same", "differs", "missing")
    }
    lines.append(
        f"check: of {len(statuses)} pinned files {counts['same']} same, "
        f"{counts['differs']} differ, {counts['missing']} missing"
    )
    return lines


# Obtaining the pinned sdist when neither --sdist nor --vllm-src is given.

# vLLM's setup.py needs these to prepare the sdist's metadata, which pip does
# even for a download; with build isolation pip would build torch from source
# (`--no-binary :all:` reaches the build environment too), so they go in a
# scratch venv that also sees this environment's torch.
# Their bounds are the sdist's own [build-system] ones: a venv's bundled
# setuptools (65 with Python 3.11) cannot read its SPDX license field.
BUILD_REQUIREMENTS = (
    "setuptools>=77.0.3,<81.0.0",
    "setuptools-scm>=8.0",
    "setuptools-rust>=1.9.0",
    "packaging>=24.2",
)


def cache_dir() -> Path:
    if chosen := envs.export_cache_dir():
        return Path(chosen)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "vllm-disagg"


def pinned_sdist(cache: Path | None = None, pin: Pin | None = None) -> Path:
    """The pinned sdist in the cache, downloaded first if it is not there."""
    pin = pin or Pin.current()
    cache = cache or cache_dir()
    target = cache / pin.sdist_name
    if not target.is_file():
        download_sdist(target, pin)
    digest = sha256_file(target)
    if digest != pin.sdist_sha256:
        raise ExportError(
            f"{target}: sha256 {digest} is not the pinned {pin.sdist_sha256}; "
            "delete it to download it again"
        )
    return target


def _run(
    cmd: list[str], log: Path, what: str, env: dict[str, str] | None = None
) -> None:
    with open(log, "a") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        try:
            done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        except OSError as exc:
            raise ExportError(f"{what}: {exc}") from None
    if done.returncode != 0:
        raise ExportError(
            f"{what} failed (exit {done.returncode}); its output is in {log}"
        )


def download_sdist(target: Path, pin: Pin) -> None:
    """Download the pinned sdist to ``target`` with pip, the way that needs no
    torch build: a scratch venv under the cache with vLLM's build requirements
    and this environment's torch on its path, build isolation off."""
    torch = importlib.util.find_spec("torch")
    if torch is None or torch.origin is None:
        raise ExportError(
            "torch is not installed here, and pip needs it to read the vLLM sdist's "
            "metadata while downloading it: install torch, or download the sdist and "
            "pass --sdist"
        )
    torch_site = Path(torch.origin).parent.parent
    cache = target.parent
    cache.mkdir(parents=True, exist_ok=True)
    log = cache / "download.log"
    log.write_text("")
    venv = cache / "pip-env"
    python = venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    if not python.exists():
        _run([sys.executable, "-m", "venv", str(venv)], log, f"python -m venv {venv}")
    # Every time: a no-op once they are there, a repair after a failed attempt.
    _run(
        [str(python), "-m", "pip", "install", "--quiet", *BUILD_REQUIREMENTS],
        log,
        f"installing vLLM's build requirements into {venv}",
    )
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    # A .pth line is appended to sys.path after the venv's own packages, so the
    # venv's setuptools wins over one next to torch.
    Path(purelib, "vllm_disagg_torch.pth").write_text(f"{torch_site}\n")
    env = {
        **os.environ,
        # Without it setup.py reports 0.32.0+empty and pip rejects the metadata.
        "VLLM_VERSION_OVERRIDE": pin.version,
        "VLLM_TARGET_DEVICE": "empty",
    }
    env.pop("PYTHONPATH", None)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        _run(
            [
                str(python),
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--no-binary",
                ":all:",
                "--no-build-isolation",
                "--dest",
                tmp,
                f"vllm=={pin.version}",
            ],
            log,
            f"pip download vllm=={pin.version}",
            env=env,
        )
        got = Path(tmp, pin.sdist_name)
        if not got.is_file():
            raise ExportError(
                f"pip download left no {pin.sdist_name}; its output is in {log}"
            )
        os.replace(got, target)
