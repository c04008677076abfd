"""KV connectors for tests: they move no KV, they only shape scheduling.

``DelayedLookupConnector`` holds a request the way a disaggregated decode
instance holds one whose KV is not reachable yet: for the
``lookup_delay_s`` given in the request's ``kv_transfer_params`` its
``get_num_new_matched_tokens`` answers ``None`` ("ask again later"), so the
scheduler keeps the request waiting and schedules no tokens for it. Then it
answers 0 matched tokens and the request is prefilled locally, so its output
equals a run without the connector. That makes the "a rank holding only
unschedulable requests" case of step sync testable end to end with no KV
transfer at all.

With ``lookup_release_file`` as well, the request is held until that file
exists (``lookup_delay_s`` is then only the backstop): a test releases it at
the moment it chooses instead of guessing how long a loaded machine needs.
The server must run on the test's machine; this is a testing connector only.

    --kv-transfer-config '{"kv_connector": "DelayedLookupConnector",
        "kv_connector_module_path": "vllm_disagg.testing.kv_connectors",
        "kv_role": "kv_both"}'
"""

from __future__ import annotations

import math
import os
import time
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)

from vllm_disagg.logger import init_logger

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = init_logger(__name__)

DELAY_KEY = "lookup_delay_s"
RELEASE_FILE_KEY = "lookup_release_file"
MAX_DELAY_S = 120.0


class _NoMetadata(KVConnectorMetadata):
    pass


class DelayedLookupConnector(KVConnectorBase_V1):
    """Scheduler side: delays requests that ask for it. Worker side: no-op."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        # request id -> (monotonic time its lookup "completes", release file)
        self._held: dict[str, tuple[float, str | None]] = {}

    # --- scheduler side ---

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        held = self._held.get(request.request_id)
        if held is None:
            held = (
                time.monotonic() + self._requested_delay(request),
                _release_file(request),
            )
            self._held[request.request_id] = held
        ready_at, release_file = held
        if time.monotonic() < ready_at and not (
            release_file and os.path.exists(release_file)
        ):
            return None, False
        return 0, False

    @staticmethod
    def _requested_delay(request: Request) -> float:
        params = request.kv_transfer_params or {}
        delay = params.get(DELAY_KEY, 0.0)
        if (
            isinstance(delay, bool)
            or not isinstance(delay, int | float)
            or not math.isfinite(delay)
        ):
            logger.warning("ignoring %s=%r: not a number", DELAY_KEY, delay)
            return 0.0
        return min(max(float(delay), 0.0), MAX_DELAY_S)

    def update_state_after_alloc(
        self, request, blocks, num_external_tokens: int
    ) -> None:
        pass

    def build_connector_meta(
        self, scheduler_output: SchedulerOutput
    ) -> KVConnectorMetadata:
        return _NoMetadata()

    def request_finished(self, request: Request, block_ids) -> tuple[bool, dict | None]:
        self._held.pop(request.request_id, None)
        return False, None

    # --- worker side: nothing to move ---

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(
        self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any
    ) -> None:
        pass

    def wait_for_save(self) -> None:
        pass


def _release_file(request: Request) -> str | None:
    path = (request.kv_transfer_params or {}).get(RELEASE_FILE_KEY)
    if path is not None and not isinstance(path, str):
        logger.warning("ignoring %s=%r: not a path", RELEASE_FILE_KEY, path)
        return None
    return path


__all__ = ["DELAY_KEY", "RELEASE_FILE_KEY", "DelayedLookupConnector"]
