"""The dependency check every benchmark runs first, before any server starts.

The benchmarks need a few modules that the runtime and the test tools do not
(requirements/bench.txt). Without this check a missing one (matplotlib for the
plot, say) shows up only as a traceback after the measurement, minutes in.

Each benchmark's ``main`` calls :func:`require` with the third-party modules
it imports, right after parsing its arguments (so ``--help`` still works)::

    from _deps import require  # benchmarks/ is sys.path[0] when run as a script

    require("matplotlib", "psutil")

A missing or broken module ends the run at once: one line on stderr naming
every missing module and the command that installs them, then exit status 2.
tests/benchmarks/test_benchmark_deps.py checks that every benchmark does this
and that requirements/bench.txt lists what they import.
"""

from __future__ import annotations

import importlib
import os
import platform
import sys
from pathlib import Path

REQUIREMENTS = Path(__file__).resolve().parent.parent / "requirements" / "bench.txt"
EXIT_MISSING = 2


def missing_modules(modules: tuple[str, ...] | list[str]) -> list[str]:
    """The modules among ``modules`` that cannot be imported, in order."""
    missing = []
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception:  # ImportError, or a broken install failing on import
            missing.append(name)
    return missing


def install_command() -> str:
    """How to install the benchmark requirements into the running interpreter."""

    def short(path: str | Path) -> str:
        try:
            rel = os.path.relpath(path)
        except ValueError:  # another drive (Windows)
            return str(path)
        return str(path) if rel.startswith(os.pardir) else rel

    return f"{short(sys.executable)} -m pip install -r {short(REQUIREMENTS)}"


def require(*modules: str) -> None:
    """Exit with status 2 and one line on stderr unless all ``modules`` import."""
    missing = missing_modules(modules)
    if missing:
        script = Path(sys.argv[0]).name or "benchmark"
        print(
            f"{script}: missing Python module{'s' if len(missing) > 1 else ''} "
            f"{', '.join(missing)}; install the benchmark requirements with: "
            f"{install_command()}",
            file=sys.stderr,
        )
        sys.exit(EXIT_MISSING)


def machine() -> str:
    """One line naming the machine, for the results every benchmark writes."""
    try:
        model = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    except (OSError, StopIteration):
        model = platform.processor()
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30)
    return f"{os.cpu_count()} CPUs ({model}), {mem:.0f} GiB, {platform.platform()}"
