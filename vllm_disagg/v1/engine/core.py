"""The DP engine core driven by step sync instead of waves.

``StepSyncDPEngineCoreProc`` replaces upstream's ``DPEngineCoreProc``. The
rule of its busy loop, on every rank:

* the scheduler produced tokens -> a real forward pass (step ``local+1``);
  the participant asks the coordinator to extend the group's step first;
* otherwise, if ``local_step < coord_step`` -> a dummy forward pass;
* otherwise -> block on the input queue (requests, utility calls, grants).

Every branch depends only on this rank's own scheduler and on the grants,
which all ranks receive in the same order, so every rank runs exactly
``coord_step`` forward passes. No all-reduce in the loop, no waves: nothing
outside the engines needs to know the ranks are coupled.

A "real" forward pass is a ``schedule()`` with scheduled tokens: an
``execute_model`` for zero tokens (only finished requests, or requests
waiting for remote KV) runs no model code and no collectives, so it is not a
step. A rank whose requests are all unschedulable therefore neither asks for
steps nor spins dummy passes; it runs dummies only while it owes them.
"""

from __future__ import annotations

import enum
import os
import threading
from typing import Any

from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.engine import EngineCoreOutputs, EngineCoreRequestType
from vllm.v1.engine.core import DPEngineCoreProc, EngineCoreProc
from vllm.v1.request import Request

from vllm_disagg.errors import ConfigError
from vllm_disagg.logger import init_logger
from vllm_disagg.v1.engine.step_sync import (
    Coordinator,
    GroupPaused,
    GroupResumed,
    Participant,
    PhaseEvent,
    StepSyncConfig,
)
from vllm_disagg.v1.metrics.step_sync import StepSyncMetricsWriter

logger = init_logger(__name__)

# Key under which DP rank 0 publishes the coordinator address in the DP
# group's TCP store (the store every rank already met at to form the group).
STORE_KEY = "vllm_disagg/step_sync/coordinator_address"


class StepSyncInput(enum.Enum):
    """Items the step-sync threads put on the engine's input queue."""

    GRANT = "step_sync_grant"
    PHASE = "step_sync_phase"
    FAILED = "step_sync_failed"


class PausePhase(enum.Enum):
    RUNNING = "running"
    # pause_scheduler() called; waiting for local drain, then for the group.
    PAUSING = "pausing"
    PAUSED = "paused"
    # resume_scheduler() called; waiting for every rank to resume.
    RESUMING = "resuming"


class StepSyncFailure(RuntimeError):
    pass


class _WaveAudit:
    """Counts wave traffic crossing this engine's boundary; step sync sends
    and expects none, so anything counted here is a bug somewhere."""

    def __init__(self):
        self.start_dp_wave_received = 0
        self.wave_stamped_requests = 0
        self.wave_outputs_sent = 0

    def as_dict(self) -> dict[str, int]:
        return dict(vars(self))


class _AuditedOutputQueue:
    """Wraps the engine's output queue to count outputs carrying wave fields."""

    def __init__(self, inner, audit: _WaveAudit):
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


class StepSyncDPEngineCoreProc(DPEngineCoreProc):
    """DP engine core for MoE models, kept in lockstep by step sync."""

    def __init__(self, vllm_config, *args, **kwargs):
        parallel_config = vllm_config.parallel_config
        if parallel_config.enable_elastic_ep:
            raise ConfigError(
                "step sync does not support elastic EP (--enable-elastic-ep); "
                "set VLLM_DISAGG_DISABLE=1 to use upstream DP waves"
            )
        self.step_sync_config = StepSyncConfig.from_additional_config(
            vllm_config.additional_config, parallel_config.data_parallel_size
        )
        self.step_sync_coordinator: Coordinator | None = None
        self.step_sync: Participant | None = None
        self.pause_phase = PausePhase.RUNNING
        self._pause_reported = False
        self.wave_audit = _WaveAudit()
        self._metrics: StepSyncMetricsWriter | None = None
        super().__init__(vllm_config, *args, **kwargs)
        self.output_queue = _AuditedOutputQueue(self.output_queue, self.wave_audit)
        # The decision "this is a real forward pass" is made by schedule();
        # ask for steps there, before execute_model can enter a collective.
        self._upstream_schedule = self.scheduler.schedule
        self.scheduler.schedule = self._schedule_and_account
        self._metrics = StepSyncMetricsWriter(self.dp_rank, self._metrics_snapshot)
        logger.info(
            "vllm_disagg: step sync DP engine core dp_rank=%d/%d lookahead=%d "
            "peer_timeout_s=%s coordinator=%s",
            self.dp_rank,
            self.dp_size,
            self.step_sync_config.lookahead,
            self.step_sync_config.peer_timeout_s,
            self.step_sync.coordinator_address if self.step_sync else None,
        )

    # --- set-up and tear-down ---

    def _init_data_parallel(self, vllm_config):
        super()._init_data_parallel(vllm_config)
        config = self.step_sync_config
        if self.dp_rank == 0:
            host = vllm_config.parallel_config.data_parallel_master_ip
            self.step_sync_coordinator = Coordinator(
                config, f"tcp://{host}:0", on_failure=self._on_step_sync_failure
            ).start()
            self.dp_store.set(STORE_KEY, self.step_sync_coordinator.address)
            address = self.step_sync_coordinator.address
        else:
            address = self.dp_store.get(STORE_KEY).decode()
        self.step_sync = Participant(
            config,
            self.dp_rank,
            address,
            on_grant=lambda step: self.input_queue.put_nowait((StepSyncInput.GRANT, step)),
            on_failure=self._on_step_sync_failure,
            on_phase=lambda event: self.input_queue.put_nowait((StepSyncInput.PHASE, event)),
        )
        self.step_sync.start()

    def _on_step_sync_failure(self, reason: str) -> None:
        """Network thread: a peer died or went silent. Wake the engine thread
        with the error; if it is stuck in a collective with the dead peer it
        cannot take it, so end the process after a grace period."""
        if not self.is_running():
            return  # shutting down anyway; peers going away is expected
        self.input_queue.put_nowait((StepSyncInput.FAILED, reason))
        grace_s = min(5.0, self.step_sync_config.peer_timeout_s)

        def hard_exit():
            logger.critical(
                "step sync: engine core dp_rank=%d did not stop %.1fs after: %s; exiting",
                self.dp_rank,
                grace_s,
                reason,
            )
            os._exit(1)

        timer = threading.Timer(grace_s, hard_exit)
        timer.daemon = True
        timer.start()

    def shutdown(self):
        for part in (self.step_sync, self.step_sync_coordinator, self._metrics):
            if part is not None:
                part.close()
        super().shutdown()

    # --- the loop ---

    def has_work(self) -> bool:
        return (
            self.scheduler.has_requests()
            or bool(self.batch_queue)
            or (self.step_sync is not None and self.step_sync.steps_owed > 0)
        )

    def _schedule_and_account(self, *args, **kwargs) -> SchedulerOutput:
        scheduler_output = self._upstream_schedule(*args, **kwargs)
        if scheduler_output.total_num_scheduled_tokens > 0:
            self.step_counter = self.step_sync.begin_forward(dummy=False)
        return scheduler_output

    def run_busy_loop(self):
        """Run real passes when scheduled, dummy passes while owed, else block."""
        while self._handle_shutdown():
            self._process_input_queue()
            self._maybe_publish_request_counts()
            executed = self._process_engine_step()
            if (
                not executed
                and self.step_sync.steps_owed > 0
                and not self.model_executor.is_sleeping
            ):
                self.step_counter = self.step_sync.begin_forward(dummy=True)
                self.execute_dummy_batch()
            self._maybe_report_pause()
            self._maybe_publish_request_counts()
            self._metrics.maybe_write()
        raise SystemExit

    def _process_input_queue(self):
        if not self.has_work():
            # About to block: publish the state the group settled at.
            self._metrics.maybe_write(force=True)
        super()._process_input_queue()

    def _handle_client_request(self, request_type: Any, request: Any) -> None:
        if request_type is StepSyncInput.GRANT:
            self.step_sync.observe_grant(request)
            logger.debug(
                "step sync: dp_rank=%d grant coord_step=%d local_step=%d",
                self.dp_rank,
                self.step_sync.coord_step,
                self.step_sync.local_step,
            )
        elif request_type is StepSyncInput.PHASE:
            self._on_phase(request)
        elif request_type is StepSyncInput.FAILED:
            raise StepSyncFailure(f"DP rank {self.dp_rank}: {request}")
        elif request_type == EngineCoreRequestType.START_DP_WAVE:
            self.wave_audit.start_dp_wave_received += 1
            logger.warning_once("step sync: ignoring START_DP_WAVE (waves are not used)")
        else:
            # Skip DPEngineCoreProc's wave handling.
            EngineCoreProc._handle_client_request(self, request_type, request)

    def add_request(self, request: Request, request_wave: int = 0):
        if request_wave:
            self.wave_audit.wave_stamped_requests += 1
        EngineCoreProc.add_request(self, request, request_wave)
        # Wake the peers now rather than at schedule(), as upstream's front
        # end did with FIRST_REQ. A request with KV transfer params will likely
        # wait for remote KV first; it asks when it is scheduled.
        if not request.kv_transfer_params and not self.is_scheduler_paused():
            self.step_sync.request_ahead()

    def _has_global_unfinished_reqs(self, local_unfinished: bool) -> bool:
        raise AssertionError("step sync DP engines never all-reduce in the busy loop")

    # --- pause as a group phase ---

    def _pause_complete(self) -> bool:
        """pause_scheduler() set the local pause state; the pause completes
        (idle callbacks run) only once the whole group stopped at one step."""
        if self.pause_phase in (PausePhase.RUNNING, PausePhase.RESUMING):
            self.pause_phase = PausePhase.PAUSING
            self._pause_reported = False
        self._maybe_report_pause()
        return self.pause_phase == PausePhase.PAUSED and not self.has_work()

    def _maybe_report_pause(self) -> None:
        if (
            self.pause_phase == PausePhase.PAUSING
            and not self._pause_reported
            and not self.scheduler.has_requests()
            and not self.batch_queue
        ):
            # Locally drained: no more real passes. Every step this rank asked
            # for went out before this message on the same channel.
            self.step_sync.request_pause()
            self._pause_reported = True

    def _notify_idle_state_callbacks(self) -> None:
        if self.pause_phase == PausePhase.PAUSING:
            return  # idle here, but the group has not agreed on the last step
        super()._notify_idle_state_callbacks()

    def _on_phase(self, event: PhaseEvent) -> None:
        if isinstance(event, GroupPaused):
            self.step_sync.observe_grant(event.step)
            if self.pause_phase == PausePhase.PAUSING:
                self.pause_phase = PausePhase.PAUSED
            logger.info(
                "step sync: dp_rank=%d group paused at step %d (local %d)",
                self.dp_rank,
                event.step,
                self.step_sync.local_step,
            )
        elif isinstance(event, GroupResumed) and self.pause_phase == PausePhase.RESUMING:
            self.pause_phase = PausePhase.RUNNING
            EngineCoreProc.resume_scheduler(self)
            logger.info("step sync: dp_rank=%d group resumed", self.dp_rank)

    def resume_scheduler(self) -> None:
        if self.pause_phase == PausePhase.PAUSING:
            raise RuntimeError(
                "resume_scheduler called while pause is still in flight. "
                "Wait for the pause future to resolve before resuming."
            )
        if self.pause_phase != PausePhase.PAUSED:
            logger.debug("Resume called while engines are not paused, ignoring.")
            return
        # Scheduling restarts when every rank has resumed (GroupResumed).
        self.pause_phase = PausePhase.RESUMING
        self.step_sync.request_resume()

    def is_scheduler_paused(self) -> bool:
        return self.pause_phase != PausePhase.RUNNING or super().is_scheduler_paused()

    # --- observability ---

    def _metrics_snapshot(self) -> dict[str, int]:
        stats: dict[str, int] = {}
        if self.step_sync is not None:
            stats.update(self.step_sync.stats)
        if self.step_sync_coordinator is not None:
            stats.update(
                {f"coordinator_{k}": v for k, v in self.step_sync_coordinator.stats.items()}
            )
        stats.update(self.wave_audit.as_dict())
        return stats


__all__ = ["STORE_KEY", "StepSyncDPEngineCoreProc", "StepSyncFailure"]
