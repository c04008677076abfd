"""What a failed call says about the instance it went to.

A refused connection proves nothing listens there (the registry drops the
instance); a reset or a 5xx is the instance's failure; a timeout is only a
suspicion, which the instance's ``/health`` settles, so that a client's long
request cannot open a healthy instance's breaker for everyone.
"""

from __future__ import annotations

import asyncio
import errno
from collections.abc import Callable

import aiohttp

from vllm_disagg.router.metrics import LegFailure, RouterMetrics
from vllm_disagg.router.registry import Instance, InstanceRegistry
from vllm_disagg.wire.logs import RateLimitedLog


def out_of_descriptors(error: BaseException) -> bool:
    """The router's own shortage of sockets or buffers, not the instance's."""
    os_error = (
        error.os_error if isinstance(error, aiohttp.ClientConnectorError) else error
    )
    return isinstance(os_error, OSError) and os_error.errno in (
        errno.EMFILE,
        errno.ENFILE,
        errno.ENOBUFS,
        errno.ENOMEM,
    )


def refused(error: BaseException) -> bool:
    return isinstance(error, aiohttp.ClientConnectorError) and isinstance(
        error.os_error, ConnectionRefusedError
    )


class InstanceHealth:
    """Judges failed calls, and probes the instances a timeout makes suspect."""

    def __init__(
        self,
        registry: InstanceRegistry,
        metrics: RouterMetrics,
        connect_timeout_s: float,
        session: Callable[[], aiohttp.ClientSession],
        limited_log: RateLimitedLog,
    ) -> None:
        self.registry = registry
        self.metrics = metrics
        self.connect_timeout_s = connect_timeout_s
        self._session = session
        self.limited_log = limited_log
        self._probing: set[str] = set()  # instance ids with a probe in flight
        self._probes: set[asyncio.Task] = set()

    @property
    def probes_in_flight(self) -> int:
        return len(self._probes)

    def close(self) -> None:
        for task in self._probes:
            task.cancel()

    def judge(
        self, instance: Instance, error: BaseException
    ) -> tuple[LegFailure, bool | None]:
        """Why a call to ``instance`` failed, and what that says about the
        instance (``Lease.release``'s ``ok``): a refused connection drops
        it; a timeout is only a suspicion (``suspect``)."""
        if refused(error):
            self.registry.mark_unreachable(instance.http_addr)
            return LegFailure.REFUSED, False
        if out_of_descriptors(error):
            self.limited_log.warning(
                "descriptors",
                "router: out of file descriptors or "
                "buffers (%s); lower --max-connections or raise the "
                "limit",
                error,
            )
            return LegFailure.LOCAL, None
        if isinstance(error, TimeoutError):  # aiohttp's ConnectionTimeoutError is one
            self.suspect(instance)
            if isinstance(error, aiohttp.ConnectionTimeoutError):
                return LegFailure.CONNECT_TIMEOUT, None
            return LegFailure.TIMEOUT, None
        if isinstance(error, aiohttp.ClientConnectionError):
            return LegFailure.CONNECTION, False
        return LegFailure.ERROR, False

    def suspect(self, instance: Instance) -> None:
        """A request to ``instance`` timed out. A long prompt or a long
        generation does that as well as a stuck instance, and a client must
        not be able to open an instance's breaker for everyone: the
        instance's ``/health`` decides. Only an instance that cannot answer
        it within ``connect_timeout_s`` counts a failure. One probe per
        instance at a time."""
        if instance.instance_id in self._probing:
            return
        self._probing.add(instance.instance_id)
        task = asyncio.create_task(self._probe(instance))
        self._probes.add(task)
        task.add_done_callback(self._probes.discard)

    async def _probe(self, instance: Instance) -> None:
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                async with self._session().get(
                    f"http://{instance.http_addr}/health"
                ) as resp:
                    healthy = resp.status == 200
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            healthy = False
            if refused(e):
                self.registry.mark_unreachable(instance.http_addr)
        finally:
            self._probing.discard(instance.instance_id)
        self.metrics.health_probes.labels("ok" if healthy else "failed").inc()
        if not healthy:
            self.limited_log.warning(
                "probe-failed",
                "instance %s (%s) timed out a request and does not answer /health",
                instance.instance_id,
                instance.http_addr,
            )
            self.registry.report(instance, False)
