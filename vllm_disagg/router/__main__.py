"""``vllm-disagg-router`` / ``python -m vllm_disagg.router``: run one router.

Serves HTTP (default 10001) and service discovery (default 30001) until
SIGINT or SIGTERM, then drains in-flight requests for a few seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

import zmq

from vllm_disagg.errors import ConfigError
from vllm_disagg.router.app import create_app, serve
from vllm_disagg.router.config import RouterConfig

PROG = "vllm-disagg-router"


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=(
            "The xPyD router: picks a prefill and a decode instance per request, "
            "learns instances from their registrations (discovery port) or from "
            "--static-*."
        ),
    )
    return RouterConfig.add_cli_args(parser)


async def _run(config: RouterConfig) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if config.workers > 1:
        from vllm_disagg.router.workers import Supervisor

        await Supervisor(config).run(stop)
    else:
        await serve(create_app(config), shutdown_trigger=stop.wait)


def main(argv: list[str] | None = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    try:
        config = RouterConfig.from_cli_args(args)
    except ConfigError as e:
        parser.exit(2, f"{PROG}: error: {e}\n")
    logging.basicConfig(
        level=config.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        import uvloop
    except ImportError:
        runner = asyncio.run
    else:
        runner = uvloop.run
    try:
        runner(_run(config))
    except (OSError, zmq.ZMQError) as e:  # a port in use, an address not on this host
        print(f"{PROG}: error: cannot listen: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
