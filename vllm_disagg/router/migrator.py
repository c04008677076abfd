"""Moving a request whose decode failed to another (prefill, decode) pair.

* A stream that already reached the client (``relay.py`` calls
  :meth:`Migrator.resume`): the prompt's and the generated token ids go to a
  new pair as a ``/v1/completions`` prompt, with what is left of the token
  limit; the new prefill computes the prefix and sends its KV as for any
  request, and the new decode's chunks continue the client's stream
  (``migration.StreamLedger`` rewrites them).
* A request whose decode failed before the client got a byte (a
  non-streamed answer is one byte at the end, so a decode dying while it
  generates is this case too): :meth:`RequestProxy` runs it again on another
  pair from the start; nothing was sent, and greedy or seeded output is the
  same.

Neither goes back to a decode that failed this request, and each request
moves at most ``--max-migrations`` times.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import aiohttp

from vllm_disagg.router.config import RouterConfig
from vllm_disagg.router.exchange import Exchange, decode_body
from vllm_disagg.router.health import InstanceHealth
from vllm_disagg.router.legs import DecodeLost, Legs
from vllm_disagg.router.metrics import Outcome, RouterMetrics
from vllm_disagg.router.migratable import MIGRATED_PATHS, not_migratable_reason
from vllm_disagg.router.migration import Opened, Refused, StreamLedger
from vllm_disagg.router.registry import Instance, InstanceRegistry, Lease
from vllm_disagg.router.replies import Reply
from vllm_disagg.router.validation import lax_bool
from vllm_disagg.wire.discovery import Role
from vllm_disagg.wire.logs import RateLimitedLog

# The ``outcome`` label of migrations_total.
RESUMED = "resumed"  # a stream continued on another pair
RESTARTED = "restarted"  # run again from the start, before the first byte
NO_PAIR = "no_pair"  # no other healthy pair: the client got an error
LIMIT = "limit"  # --max-migrations used up: the client got an error
NOT_MIGRATABLE = "not_migratable"  # its continuation would not be exact
NOT_JOINED = "not_joined"  # the continuation did not repeat what was sent
OUTCOMES = (RESUMED, RESTARTED, NO_PAIR, LIMIT, NOT_MIGRATABLE, NOT_JOINED)


class Migrator:
    """Plans migration for each request and opens continuations."""

    def __init__(
        self,
        config: RouterConfig,
        registry: InstanceRegistry,
        metrics: RouterMetrics,
        health: InstanceHealth,
        legs: Legs,
        pick: Callable[..., Instance | None],
        limited_log: RateLimitedLog,
    ) -> None:
        self.config = config
        self.registry = registry
        self.metrics = metrics
        self.health = health
        self.legs = legs
        self._pick = pick
        self.limited_log = limited_log

    def plan(self, ex: Exchange) -> None:
        """Make ``ex`` migratable where it can be: a stream's decode leg is
        asked for token ids (``ex.ledger``); a request not yet answered may
        run again elsewhere (``ex.restartable``)."""
        if not self.config.max_migrations or ex.path not in MIGRATED_PATHS:
            return
        ex.restartable = True
        if not ex.stream:
            return
        reason = not_migratable_reason(ex.body, ex.path)
        if reason is not None:
            ex.not_migratable = reason
            return
        client_ids = lax_bool(ex.body.get("return_token_ids")) is True
        ex.ledger = StreamLedger(ex.body, ex.path, client_ids)
        if not client_ids:
            ex.body = {**ex.body, "return_token_ids": True}

    def refuse(self, ex: Exchange, outcome: str, reason: str = "") -> Refused:
        self.metrics.migrations.labels(outcome, reason).inc()
        messages = {
            NO_PAIR: "and no other healthy pair of instances can continue it",
            LIMIT: "and the request was already moved "
            f"{self.config.max_migrations} time(s) (--max-migrations)",
            NOT_MIGRATABLE: "and the request cannot be continued exactly "
            f"elsewhere ({reason})",
        }
        return Refused(outcome, messages[outcome])

    async def restart(
        self,
        ex: Exchange,
        lost: DecodeLost,
        handoff: Callable[[Exchange, Instance, str | None], Awaitable[Reply]],
        pick_paired: Callable[[Exchange, set[str]], Instance | None],
    ) -> Reply:
        """D failed before the client got a byte (a non-streamed answer while
        it generated): run the request again on another pair (``handoff``
        through a decode ``pick_paired`` found), never on a decode that
        failed it, at most ``--max-migrations`` times; else 503 / 502."""
        while True:
            ex.failed_decodes.add(lost.instance.instance_id)
            failed = f"the decode instance failed ({lost.reason})"
            if ex.migrations >= self.config.max_migrations:
                refused = self.refuse(ex, LIMIT)
                return ex.error(
                    Outcome.UPSTREAM_ERROR, 502, f"{failed} {refused.message}"
                )
            decode = pick_paired(ex, ex.failed_decodes)
            if decode is None:
                refused = self.refuse(ex, NO_PAIR)
                return ex.error(
                    Outcome.UPSTREAM_ERROR, 503, f"{failed} {refused.message}"
                )
            ex.migrations += 1
            self.limited_log.warning(
                "migration",
                "decode %s failed request %s (%s) before its first byte: running "
                "it on %s",
                lost.instance.http_addr,
                ex.request_id,
                lost.reason,
                decode.http_addr,
            )
            self.metrics.migrations.labels(RESTARTED, lost.reason).inc()
            ex.renew_key()
            if ex.ledger is not None:
                ex.ledger.reset_buffer()
            started = time.monotonic()
            try:
                reply = await handoff(ex, decode, None)
            except DecodeLost as again:
                lost = again
                continue
            self.metrics.migration_latency.observe(time.monotonic() - started)
            return reply

    async def resume(
        self, ex: Exchange, failed: Instance, why: str
    ) -> Opened | Refused:
        """Continue ``ex``'s stream on another pair after ``failed`` broke it
        (``why``: broken, ended, stalled). Returns the new decode's open
        response, or why not."""
        ledger = ex.ledger
        assert ledger is not None
        ex.failed_decodes.add(failed.instance_id)
        reason = ledger.why_not_resumable() if ledger.finish_reason is None else None
        if reason is not None:
            return self.refuse(ex, NOT_MIGRATABLE, reason)
        if ex.migrations >= self.config.max_migrations:
            return self.refuse(ex, LIMIT)
        ex.migrations += 1
        started = time.monotonic()
        body = ledger.continuation_body()
        self.limited_log.warning(
            "migration",
            "decode %s %s request %s after %d tokens: continuing on another pair",
            failed.http_addr,
            why,
            ex.request_id,
            len(ledger.generated),
        )
        ledger.start_continuation()
        opened = await self.open_continuation(ex, body)
        if isinstance(opened, Opened):
            self.metrics.migrations.labels(RESUMED, why).inc()
            self.metrics.migration_latency.observe(time.monotonic() - started)
        return opened

    async def open_continuation(self, ex: Exchange, body: dict) -> Opened | Refused:
        """Send ``body`` through a new pair: a decode this request has not
        failed on, a prefill that computes the prefix and hands over its
        KV; the decode's response once its first bytes came."""
        child = ex.continuation(body)
        tried = set(ex.failed_decodes)
        for _ in range(self.config.max_retries + 1):
            decode = self._pick(Role.DECODE, child, tried, model=ex.model)
            if decode is None:
                break
            tried.add(decode.instance_id)
            lease = self.registry.reserve(decode)
            try:
                opened = await self._open_on(ex, child, lease)
            except BaseException:
                lease.release(None)
                raise
            if opened is not None:
                return opened
        return self.refuse(ex, NO_PAIR)

    async def _open_on(
        self, ex: Exchange, child: Exchange, lease: Lease
    ) -> Opened | None:
        """The continuation on ``lease``'s decode (None: it did not start;
        a decode that failed joins ``ex.failed_decodes``)."""
        decode = lease.instance
        prefill = await self._prefill(child, decode)
        if prefill is None and not self.config.fallback_to_decode_prefill:
            lease.release(None)
            return None
        if prefill is not None:
            request_id, peers = child.name_peers(prefill, decode, self.config.token)
            sent = decode_body(child.body, peers)
        else:
            request_id, sent = child.request_id, decode_body(child.body, None)
        resp: aiohttp.ClientResponse | None = None
        ok: bool | None = None
        try:
            limit = min(self.config.first_token_timeout_s, child.remaining())
            async with asyncio.timeout(limit):
                resp = await self.legs.post(child, decode, sent, request_id)
                if resp.status != 200 or resp.content_type != "text/event-stream":
                    ok = resp.status < 500
                    self.limited_log.warning(
                        "migration-status",
                        "continuation on %s answered %d",
                        decode.http_addr,
                        resp.status,
                    )
                    return None
                first = await resp.content.readany()
            ok = True
            opened = Opened(lease.transfer(), resp, first)
            resp = None
            return opened
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            _, ok = self.health.judge(decode, e)
            if ok is False:
                ex.failed_decodes.add(decode.instance_id)
            return None
        finally:
            lease.release(ok)
            if resp is not None:
                resp.release()

    async def _prefill(self, child: Exchange, decode: Instance) -> Instance | None:
        """A prefill that computed the continuation's prompt for ``decode``."""
        tried = {decode.instance_id}
        for _ in range(self.config.max_retries + 1):
            prefill = self._pick(
                Role.PREFILL, child, tried, model=decode.model, partner=decode
            )
            if prefill is None:
                return None
            tried.add(prefill.instance_id)
            result = await self.legs.prefill(child, prefill, decode)
            if result.ok:
                return prefill
            if result.reply is not None:  # the continuation itself refused
                return None
        return None
