"""The wave audit: proof that no DP wave traffic crosses a step-sync engine.

Step sync replaces upstream's waves; a START_DP_WAVE received, a request
stamped with a wave, or an output carrying ``wave_complete`` / ``start_wave``
means something outside the engines still speaks waves. The engine core
counts all three here (its output queue wrapped), and the counters go out
with step sync's metrics (``vllm_disagg:step_sync_wave_outputs_sent_total``
and its two siblings stay 0). Apart from the engine core, whose busy loop is
the protocol.
"""

from __future__ import annotations

from vllm.v1.engine import EngineCoreOutputs


class WaveAudit:
    """Counts wave traffic crossing this engine's boundary; step sync sends
    and expects none, so anything counted here is a bug somewhere."""

    def __init__(self):
        self.start_dp_wave_received = 0
        self.wave_stamped_requests = 0
        self.wave_outputs_sent = 0

    def as_dict(self) -> dict[str, int]:
        return dict(vars(self))


class AuditedOutputQueue:
    """Wraps the engine's output queue to count outputs carrying wave fields."""

    def __init__(self, inner, audit: WaveAudit):
        self._inner = inner
        self._audit = audit

    def put_nowait(self, item):
        if isinstance(item, tuple) and isinstance(item[1], EngineCoreOutputs):
            outputs = item[1]
            if outputs.wave_complete is not None or outputs.start_wave is not None:
                self._audit.wave_outputs_sent += 1
        self._inner.put_nowait(item)

    def __getattr__(self, name):
        return getattr(self._inner, name)
