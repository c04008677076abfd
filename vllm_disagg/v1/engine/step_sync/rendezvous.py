"""How the ranks of a DP group find their coordinator: the DP group's TCP store.

Rank 0 starts the :class:`Coordinator` and publishes, under one key of the store
that every rank already met at to form the DP group, where it listens, the group's
id and the protocol version (:class:`GroupAddress`); the other ranks read it. All of
it is public: anyone who can connect to the store can read it (and write it, as they
can upstream's own keys). What makes a frame count is the key only members can
derive, :func:`~.credentials.group_key` of the group's secret and this id.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec
from vllm.utils.network_utils import make_zmq_path

from vllm_disagg.v1.engine.step_sync.config import StepSyncConfig
from vllm_disagg.v1.engine.step_sync.coordinator import Coordinator
from vllm_disagg.v1.engine.step_sync.coordinator_process import CoordinatorProcess
from vllm_disagg.v1.engine.step_sync.credentials import (
    GroupSecret,
    group_key,
    new_group_id,
)
from vllm_disagg.v1.engine.step_sync.messages import PROTOCOL_VERSION, GroupState
from vllm_disagg.v1.engine.step_sync.participant import (
    Participant,
    StepSyncGroupError,
)

STORE_KEY = "vllm_disagg/step_sync/group"


class GroupAddress(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    version: int
    address: str
    group_id: str


def publish(store, address: str, group_id: str) -> None:
    store.set(
        STORE_KEY,
        msgspec.json.encode(GroupAddress(PROTOCOL_VERSION, address, group_id)),
    )


def lookup(store) -> GroupAddress:
    """What rank 0 published (waits for it as the store's ``get`` does)."""
    raw = store.get(STORE_KEY)
    try:
        found = msgspec.json.decode(raw, type=GroupAddress)
    except msgspec.DecodeError:
        raise StepSyncGroupError(
            f"the DP group's store holds no step-sync address under {STORE_KEY!r} "
            "(DP rank 0 runs another version of step sync)"
        ) from None
    if found.version != PROTOCOL_VERSION:
        raise StepSyncGroupError(
            f"DP rank 0 speaks step-sync protocol {found.version}, this rank "
            f"{PROTOCOL_VERSION}: every rank needs the same version"
        )
    return found


def join(
    config: StepSyncConfig,
    dp_rank: int,
    store,
    secret: GroupSecret,
    host: str,
    on_grant: Callable[[int], None],
    on_failure: Callable[[str], None],
    on_group: Callable[[GroupState], None] | None = None,
    logging_config=None,
) -> tuple[Coordinator | CoordinatorProcess | None, Participant]:
    """Start this rank's side of the group (and, on rank 0, the coordinator on
    ``host``, a free port, in a thread or a child process as ``config`` says);
    returns both, started. The caller waits for the group
    (:meth:`Participant.wait_for_group`). ``logging_config``: vLLM's, for a
    coordinator process."""
    coordinator = None
    if dp_rank == 0:
        group_id = new_group_id()
        key = group_key(secret.value, group_id)
        address = make_zmq_path("tcp", host, 0)
        if config.coordinator_in_process:
            coordinator = CoordinatorProcess(
                config, address, key, on_failure, logging_config=logging_config
            ).start()
        else:
            coordinator = Coordinator(config, address, key, on_failure).start()
        address = coordinator.address
        publish(store, address, group_id)
    else:
        found = lookup(store)
        address, key = found.address, group_key(secret.value, found.group_id)
    participant = Participant(
        config,
        dp_rank,
        address,
        key,
        on_grant=on_grant,
        on_failure=on_failure,
        on_group=on_group,
    ).start()
    return coordinator, participant


def not_formed_hint(participant: Participant, secret: GroupSecret) -> str:
    """What to check when a rank never heard the coordinator: it sends nothing to a
    rank it cannot authenticate."""
    if participant.group is not None:
        return ""
    return (
        "; no authenticated answer from the coordinator: is it reachable, and do all "
        f"ranks share one step-sync secret? (this rank's: {secret.source})"
    )
