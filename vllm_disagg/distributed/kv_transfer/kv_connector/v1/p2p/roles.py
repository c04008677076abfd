"""The connector's name and the three ``kv_role`` values, named once, the
roles typed as vLLM types them.

vLLM's ``KVTransferConfig.kv_role`` is a ``KVRole`` (``vllm/config/kv_transfer.py``:
``kv_producer`` and ``kv_both`` are producers, ``kv_consumer`` and ``kv_both``
consumers); the connector compares roles with these names, never with
literals. vLLM is imported for the type checker only, so the options module can
use them without importing vLLM.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from vllm.config.kv_transfer import KVRole

KV_PRODUCER: Final[KVRole] = "kv_producer"  # prefill
KV_CONSUMER: Final[KVRole] = "kv_consumer"  # decode
KV_BOTH: Final[KVRole] = (
    "kv_both"  # either side, chosen per request by the addresses it names
)
# In the order configuration errors list them.
KV_ROLES: Final[tuple[KVRole, ...]] = (KV_PRODUCER, KV_CONSUMER, KV_BOTH)

# kv_transfer_config.kv_connector of this connector.
CONNECTOR_NAME: Final = "P2pNcclConnector"
