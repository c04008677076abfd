"""Scheduler side of the P2P connector: which requests load or send KV, and when.

Decode (``kv_consumer``, or ``kv_both`` named as the decode peer): a request
whose peers are known claims every prompt token its own prefix cache does not
hold, as an *asynchronous* load, so it waits in ``WAITING_FOR_REMOTE_KVS``
while the rest of the batch runs. The workers receive only the blocks after
the local prefix hit. A request is loaded at most once: after a preemption
it is recomputed locally (the prefill side has freed its copy by then).

Prefill (``kv_producer``, or ``kv_both`` named as the prefill peer): in the
step whose forward pass completes the prompt (the last chunk under chunked
prefill), the workers are told to send (PUT, PUT_ASYNC) or hold (GET) the
prompt's blocks, and ``request_finished`` delays freeing them until the
workers report the send finished (sent, refused or expired).

Both sides act on the peers a request names only when a router grant or the
operator's ``allowed_peers`` vouches for them (:class:`PeerVouching`);
otherwise the request is computed locally and counted (``refused_peers``).
A transfer key is used once per side: the children of ``n > 1``, beam
search's per-step requests and a retried id carry the key of a transfer that
is already under way or done, and are computed locally at once instead of
waiting for KV that will never come a second time. A used key is remembered
as long as the router grant that vouched for it is valid (:class:`UsedKeys`),
so a captured grant never moves KV a second time.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.utils.math_utils import cdiv

from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.config import (
    P2pConfig,
    dp_rank_of,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.fingerprint import (
    model_fingerprint,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.metadata import (
    LoadSpec,
    P2pConnectorMetadata,
    SaveSpec,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.progress import (
    EngineProgress,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.protocol import (
    embeds_digest,
    prompt_digest,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.registration import (
    start_registration,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.roles import (
    KV_BOTH,
    KV_CONSUMER,
    KV_PRODUCER,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.stats import (
    P2pStatsRecorder,
)
from vllm_disagg.logger import init_logger
from vllm_disagg.wire.grants import (
    GRANT_KEY,
    MAX_GRANT_TTL_S,
    GrantError,
    check_grant,
)
from vllm_disagg.wire.peers import (
    PeerInfo,
    PeerInfoError,
    canonical_addr,
    format_addr,
    parse_peer_info,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.config.kv_transfer import KVRole
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = init_logger(__name__)

BAD_PEER_LOG_INTERVAL_S = 10.0
# Keys used once are remembered this many at most (oldest forgotten first,
# and what a forgotten one could replay refused: see UsedKeys).
MAX_USED_KEYS = 65536


class PeerVouching:
    """Whether this instance may act on the peers a request names: a valid
    router grant in ``kv_transfer_params``, or every named peer other than
    this instance on the operator's ``allowed_peers``."""

    def __init__(self, config: P2pConfig, own_addr: str):
        self._token = config.grant_token
        self._allowed = config.allowed_peers
        self._own = canonical_addr(own_addr)

    def refusal(self, peer: PeerInfo, kv_transfer_params: dict | None) -> str | None:
        """None when vouched for, else why not (for a rate-limited log line)."""
        return self.vouch(peer, kv_transfer_params)[0]

    def vouch(
        self, peer: PeerInfo, kv_transfer_params: dict | None
    ) -> tuple[str | None, int | None]:
        """(:meth:`refusal`, when the grant that vouched expires: unix
        seconds, None when no grant did)."""
        others = [
            a
            for a in (
                canonical_addr(peer.prefill_addr),
                canonical_addr(peer.decode_addr),
            )
            if a != self._own
        ]
        if not others:
            # Both sides this instance: it would wait for KV from itself.
            return "the request names this instance as both prefill and decode", None
        grant = (
            kv_transfer_params.get(GRANT_KEY)
            if isinstance(kv_transfer_params, dict)
            else None
        )
        problem = "no router token to check a grant with"
        if self._token is not None and grant is not None:
            try:
                return None, check_grant(self._token, grant, peer)
            except GrantError as e:
                problem = f"grant refused ({e})"
        elif self._token is not None:
            problem = "no grant"
        if self._allowed is not None:
            if all(self._allowed.allows(a) for a in others):
                return None, None
            problem += "; a named peer is not on allowed_peers"
        return problem, None


class UsedKeys:
    """Transfer keys this side has used: each for ``ttl_s``, and while the
    router grant that vouched for it is valid (until its ``expires``, unix
    seconds, as :func:`check_grant` compares it: at most MAX_GRANT_TTL_S
    after its use). A grant is not single-use by itself; this memory makes
    it so, on each side.

    Bounded: beyond ``max_keys`` the oldest key is forgotten, and the latest
    expiry among forgotten grants still valid is kept: a key not remembered
    whose grant expires no later may be a forgotten one and counts as used
    (its request is computed locally, :attr:`refused_forgotten` counts it).
    Refusing is the safe side; with one router, grants made later expire
    later, so a full memory refuses no fresh request.
    """

    def __init__(self, ttl_s: float, max_keys: int = MAX_USED_KEYS):
        self.ttl_s = ttl_s
        self.max_keys = max_keys
        # key -> (monotonic until, its grant's expiry or -inf)
        self._keys: OrderedDict[str, tuple[float, float]] = OrderedDict()
        self._forgotten_until = -math.inf  # latest valid grant forgotten
        self.refused_forgotten = 0
        self._last_log = -math.inf

    def __contains__(self, key: str) -> bool:
        return self.used(key)

    def used(self, key: str, grant_expires: float | None = None) -> bool:
        entry = self._keys.get(key)
        if entry is not None:
            until, expires = entry
            if time.monotonic() <= until or time.time() <= expires:
                return True
            del self._keys[key]
        if grant_expires is not None and grant_expires <= self._forgotten_until:
            self.refused_forgotten += 1
            now = time.monotonic()
            if now - self._last_log >= BAD_PEER_LOG_INTERVAL_S:
                self._last_log = now
                logger.warning(
                    "transfer key %s: its grant is no newer than grants of keys "
                    "forgotten from the full used-key memory (%d keys); computed "
                    "locally, as %d such requests so far",
                    key,
                    self.max_keys,
                    self.refused_forgotten,
                )
            return True
        return False

    def add(self, key: str, grant_expires: float | None = None) -> None:
        # check_grant accepts no grant valid for longer than MAX_GRANT_TTL_S.
        expires = (
            -math.inf
            if grant_expires is None
            else min(grant_expires, time.time() + MAX_GRANT_TTL_S)
        )
        self._keys[key] = (time.monotonic() + self.ttl_s, expires)
        self._keys.move_to_end(key)
        while len(self._keys) > self.max_keys:
            _, (_, old_expires) = self._keys.popitem(last=False)
            if old_expires >= time.time():  # its grant could still be replayed
                self._forgotten_until = max(self._forgotten_until, old_expires)


@dataclass
class _Peers:
    """What a live request that names vouched-for peers carries."""

    info: PeerInfo
    digest: bytes
    grant_expires: int | None = None  # the grant that vouched (None: no grant)


@dataclass
class _Prefill:
    peer: _Peers
    num_prompt_tokens: int
    block_ids: list[int] = field(default_factory=list)


def digest_context(model: bytes, request: Request) -> bytes:
    """What the KV of ``request`` depends on besides its prompt: the model's
    fingerprint and the request's LoRA adapter (name and path; the adapter's
    bytes are not hashed)."""
    lora = getattr(request, "lora_request", None)
    if lora is None:
        return model
    return model + f"|lora:{lora.lora_name}|{lora.lora_path}".encode()


class P2pSchedulerConnector:
    def __init__(self, vllm_config: VllmConfig, config: P2pConfig):
        self.config = config
        # KV computed under another fingerprint is never filed here: every
        # prompt digest covers it (fingerprint.py).
        self.fingerprint = model_fingerprint(vllm_config)
        self.block_size = vllm_config.cache_config.block_size
        parallel = vllm_config.parallel_config
        self.addr = format_addr(
            config.host,
            config.instance_port(
                dp_rank=dp_rank_of(parallel),
                tp_size=parallel.tensor_parallel_size,
                pp_size=parallel.pipeline_parallel_size,
            ),
        )
        self._canonical_addr = canonical_addr(self.addr)
        self._vouching = PeerVouching(config, self.addr)
        self.stats = P2pStatsRecorder()
        # Long enough that a duplicate of a request arrives within it (the
        # other side holds a key's KV at most this long), and a granted key
        # until its grant expires (at most MAX_GRANT_TTL_S after its use).
        self._used_keys = UsedKeys(
            2 * max(config.kv_load_timeout_s, config.kv_hold_timeout_s) + 60.0
        )
        # request id -> peers, for every live request that has them
        self._peers: dict[str, _Peers] = {}
        self._pending_loads: dict[str, LoadSpec] = {}
        self._unwanted: list[str] = []
        self._loaded: set[str] = set()  # requests that asked for remote KV once
        self._prefills: dict[str, _Prefill] = {}
        self._sending: set[str] = (
            set()
        )  # prefills handed to the workers: delay their free
        self._last_bad_peer_log = -BAD_PEER_LOG_INTERVAL_S
        # One registration per engine core, i.e. per DP rank, named by the
        # rank's own control address (proxy_ip set; else None).
        self.progress = EngineProgress()
        self._registration = start_registration(
            vllm_config,
            config,
            self.addr,
            progress=self.progress,
            fingerprint=self.fingerprint.digest.hex(),
        )

    def shutdown(self) -> None:
        """Deregister from the routers (EngineCore.shutdown -> Scheduler.shutdown
        -> connector.shutdown)."""
        if self._registration is not None:
            self._registration.close()
            self._registration = None

    # --- which side of the transfer a request is on ---

    def on_new_request(self, request: Request) -> None:
        self.progress.request_added(request.request_id)
        try:
            peer = parse_peer_info(request.request_id, request.kv_transfer_params)
        except PeerInfoError as e:
            self._refuse(request, f"unusable P2P peer information ({e})")
            return
        if peer is None:
            return
        refusal, grant_expires = self._vouching.vouch(peer, request.kv_transfer_params)
        if refusal is not None:
            self._refuse(request, f"nothing vouches for its P2P peers: {refusal}")
            return
        context = digest_context(self.fingerprint.digest, request)
        if request.prompt_token_ids is not None:
            digest = prompt_digest(request.prompt_token_ids, context)
        elif request.prompt_embeds is not None:
            digest = embeds_digest(request.prompt_embeds, context)
        else:
            self._refuse(
                request, "neither prompt token ids nor embeddings to check KV against"
            )
            return
        self._peers[request.request_id] = _Peers(peer, digest, grant_expires)

    def _refuse(self, request: Request, why: str) -> None:
        self.stats.record_refused_peers()
        now = time.monotonic()
        if now - self._last_bad_peer_log >= BAD_PEER_LOG_INTERVAL_S:
            self._last_bad_peer_log = now
            logger.warning(
                "request %s: %s; it is computed locally", request.request_id, why
            )

    def take_stats(self):
        return self.stats.take()

    def _is_me(self, addr: str) -> bool:
        # Compared canonically: a proxy may spell this address differently.
        return canonical_addr(addr) == self._canonical_addr

    def _is_decode(self, peer: PeerInfo) -> bool:
        role: KVRole = self.config.role
        if role == KV_CONSUMER:
            return True
        return role == KV_BOTH and self._is_me(peer.decode_addr)

    def _is_prefill(self, peer: PeerInfo) -> bool:
        role: KVRole = self.config.role
        if role == KV_PRODUCER:
            return True
        return (
            role == KV_BOTH
            and self._is_me(peer.prefill_addr)
            and not self._is_me(peer.decode_addr)
        )

    # --- decode ---

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        peers = self._peers.get(request.request_id)
        if peers is None or request.request_id in self._loaded:
            return 0, False
        if not self._is_decode(peers.info):
            return 0, False
        if self._used_keys.used(peers.info.key, peers.grant_expires):
            # Another request (n > 1 sibling, beam step, retry, a replayed
            # grant) took this key.
            return 0, False
        if request.skip_reading_prefix_cache:
            # prompt_logprobs: vLLM computes the whole prompt here whatever
            # we say; tell the workers, so the prefill's offer is refused.
            self._used_keys.add(peers.info.key, peers.grant_expires)
            self._unwanted.append(peers.info.key)
            return 0, False
        remote = request.num_prompt_tokens - num_computed_tokens
        if remote <= 0:
            return 0, False
        return remote, True

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        req_id = request.request_id
        peers = self._peers.get(req_id)
        if num_external_tokens <= 0 or peers is None or req_id in self._loaded:
            return
        peer = peers.info
        num_prompt = request.num_prompt_tokens
        num_local = num_prompt - num_external_tokens
        num_blocks = cdiv(num_prompt, self.block_size)
        first_block = num_local // self.block_size
        block_ids = list(blocks.get_block_ids()[0])
        self._loaded.add(req_id)
        self._used_keys.add(peer.key, peers.grant_expires)
        self._pending_loads[req_id] = LoadSpec(
            request_id=req_id,
            key=peer.key,
            prefill_addr=peer.prefill_addr,
            first_block=first_block,
            block_ids=block_ids[first_block:num_blocks],
            num_blocks=num_blocks,
            prompt_digest=peers.digest,
        )

    # --- every step ---

    def build_connector_meta(
        self, scheduler_output: SchedulerOutput
    ) -> P2pConnectorMetadata:
        self.progress.step_scheduled()
        meta = P2pConnectorMetadata(
            loads=list(self._pending_loads.values()), unwanted=self._unwanted
        )
        self._pending_loads.clear()
        self._unwanted = []
        scheduled = scheduler_output.num_scheduled_tokens

        for new in scheduler_output.scheduled_new_reqs:
            peer = self._peers.get(new.req_id)
            if peer is None or not self._is_prefill(peer.info):
                continue
            prefill = _Prefill(peer, new.prompt_len, list(new.block_ids[0]))
            self._prefills[new.req_id] = prefill
            self._maybe_save(
                meta, new.req_id, new.num_computed_tokens + scheduled.get(new.req_id, 0)
            )

        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            prefill = self._prefills.get(req_id)
            if prefill is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                prefill.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids:
                prefill.block_ids.extend(new_ids[0])
            self._maybe_save(
                meta, req_id, cached.num_computed_tokens[i] + scheduled.get(req_id, 0)
            )
        return meta

    def _maybe_save(
        self, meta: P2pConnectorMetadata, req_id: str, computed_after: int
    ) -> None:
        prefill = self._prefills[req_id]
        if computed_after < prefill.num_prompt_tokens or prefill.num_prompt_tokens == 0:
            return
        del self._prefills[req_id]
        key = prefill.peer.info.key
        if self._used_keys.used(key, prefill.peer.grant_expires):
            # n > 1 siblings and retried ids share the key: one transfer per
            # key (a replayed grant: none at all).
            return
        self._used_keys.add(key, prefill.peer.grant_expires)
        num_blocks = cdiv(prefill.num_prompt_tokens, self.block_size)
        meta.saves.append(
            SaveSpec(
                request_id=req_id,
                key=key,
                decode_addr=prefill.peer.info.decode_addr,
                block_ids=prefill.block_ids[:num_blocks],
                prompt_digest=prefill.peer.digest,
            )
        )
        self._sending.add(req_id)

    # --- end of a request ---

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        self.progress.request_finished(req_id)
        self._peers.pop(req_id, None)
        self._prefills.pop(req_id, None)
        self._loaded.discard(req_id)
        if req_id in self._sending:
            self._sending.discard(req_id)
            return True, None
        return False, None
