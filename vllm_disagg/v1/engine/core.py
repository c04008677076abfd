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

Pause and shutdown are *group phases*: a rank that pauses (or is told to shut
down) first drains its own work, then says so; the coordinator agrees on the
last step once every rank did, and every rank runs its owed passes up to that
step before the pause completes (or before it leaves the busy loop).
"""

from __future__ import annotations

import contextlib
import enum
import os
import queue
import threading
import time
from concurrent.futures import Future
from typing import Any

from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreRequestType
from vllm.v1.engine.core import DPEngineCoreProc, EngineCoreProc
from vllm.v1.fault_tolerance import fault_tolerant_wrapper
from vllm.v1.request import Request

from vllm_disagg.errors import ConfigError
from vllm_disagg.logger import init_logger
from vllm_disagg.v1.engine.step_sync import (
    Coordinator,
    CoordinatorProcess,
    GroupPhase,
    Participant,
    StepSyncConfig,
    StepSyncGroupError,
)
from vllm_disagg.v1.engine.step_sync.credentials import group_secret
from vllm_disagg.v1.engine.step_sync.rendezvous import join, not_formed_hint
from vllm_disagg.v1.engine.step_sync.wave_audit import AuditedOutputQueue, WaveAudit
from vllm_disagg.v1.engine.step_sync.work_bound import (
    passes_after_this,
    passes_for_new,
)
from vllm_disagg.v1.metrics.step_sync import StepSyncMetricsWriter
from vllm_disagg.wire.groups import dp_group_of

logger = init_logger(__name__)

# Extra time a rank gives the group to form, beyond step_sync_peer_timeout_s
# (the coordinator's own registration deadline), before it gives up itself.
GROUP_FORM_MARGIN_S = 5.0
# A rank that drained for shutdown waits this long (at least; or the drain
# timeout) for every peer to shut down too, then leaves the group alone.
EXIT_GRACE_S = 5.0
# While shutting down and waiting for the group, how often the loop wakes.
SHUTDOWN_POLL_S = 0.1


class StepSyncInput(enum.Enum):
    """Items the step-sync threads put on the engine's input queue."""

    GRANT = "step_sync_grant"
    GROUP = "step_sync_group"
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


class StepSyncDPEngineCoreProc(DPEngineCoreProc):
    """DP engine core for MoE models, kept in lockstep by step sync."""

    # Set in _init_data_parallel (called from the upstream constructor);
    # present for the whole life of the busy loop.
    step_sync: Participant
    # Only on DP rank 0.
    step_sync_coordinator: Coordinator | CoordinatorProcess | None

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
        # Before anything starts (and before this process starts its workers,
        # which must not inherit the launcher's secret): fails in one line.
        self._step_sync_secret = group_secret(parallel_config)
        self.step_sync_coordinator = None
        self.pause_phase = PausePhase.RUNNING
        self._pause_intent = 0
        self._pause_reported = False
        # resume_scheduler()'s answer: resolved once the whole group runs.
        self._resumed: Future | None = None
        # Shutdown: when this rank drained and told the group it is leaving,
        # and whether it gave up waiting for the peers.
        self._leaving_since: float | None = None
        self._left_alone = False
        self.wave_audit = WaveAudit()
        super().__init__(vllm_config, *args, **kwargs)
        self.output_queue = AuditedOutputQueue(self.output_queue, self.wave_audit)
        # The decision "this is a real forward pass" is made by schedule();
        # ask for steps there, before execute_model can enter a collective.
        self._upstream_schedule = self.scheduler.schedule
        self.scheduler.schedule = self._schedule_and_account
        self._metrics = StepSyncMetricsWriter(
            self.dp_rank,
            self._metrics_snapshot,
            dp_group=dp_group_of(vllm_config.parallel_config),
        )
        # The ports this group exposes (docs/step_sync.md, "Ports"), and where its
        # secret came from (never the secret).
        logger.info(
            "vllm_disagg: step sync DP engine core dp_rank=%d/%d lookahead=%d "
            "peer_timeout_s=%s coordinator=%s dp_store=%s:%s secret from %s",
            self.dp_rank,
            self.dp_size,
            self.step_sync_config.lookahead,
            self.step_sync_config.peer_timeout_s,
            self.step_sync.coordinator_address,
            getattr(self.dp_store, "host", "?"),
            getattr(self.dp_store, "port", "?"),
            self._step_sync_secret.source,
        )

    # --- set-up and tear-down ---

    def _init_data_parallel(self, vllm_config):
        super()._init_data_parallel(vllm_config)
        config = self.step_sync_config
        # The store only says where the coordinator listens and the group's id;
        # the frames' key comes from the secret only members hold (credentials.py).
        self.step_sync_coordinator, self.step_sync = join(
            config,
            self.dp_rank,
            self.dp_store,
            self._step_sync_secret,
            vllm_config.parallel_config.data_parallel_master_ip,
            on_grant=lambda step: self.input_queue.put_nowait(
                (StepSyncInput.GRANT, step)
            ),
            on_failure=self._on_step_sync_failure,
            on_group=lambda state: self.input_queue.put_nowait(
                (StepSyncInput.GROUP, state)
            ),
            logging_config=vllm_config.logging_config,
        )
        # Every rank joins or none starts (raises with the reason).
        try:
            self.step_sync.wait_for_group(config.peer_timeout_s + GROUP_FORM_MARGIN_S)
        except StepSyncGroupError as e:
            hint = not_formed_hint(self.step_sync, self._step_sync_secret)
            raise StepSyncGroupError(f"{e}{hint}") from None

    def _on_step_sync_failure(self, reason: str) -> None:
        """Network thread: the group failed. Wake the engine thread with the
        error; if it is stuck in a collective with a dead peer it cannot take
        it, so end the process after a grace period. Stays armed during
        shutdown: a group that fails while draining must not hang either."""
        self.input_queue.put_nowait((StepSyncInput.FAILED, reason))
        grace_s = min(5.0, self.step_sync_config.peer_timeout_s)

        def hard_exit():
            logger.critical(
                "step sync: engine core dp_rank=%d did not stop %.1fs after: %s; "
                "exiting",
                self.dp_rank,
                grace_s,
                reason,
            )
            os._exit(1)

        timer = threading.Timer(grace_s, hard_exit)
        timer.daemon = True
        timer.start()

    def shutdown(self):
        # Rank 0 hosts the coordinator: after an agreed exit it stays until
        # every peer said it left; otherwise closing it aborts the peers now.
        self.step_sync.close()
        coordinator = self.step_sync_coordinator
        if coordinator is not None:
            if coordinator.phase == GroupPhase.EXITING:
                deadline = time.monotonic() + self.step_sync_config.peer_timeout_s
                while not coordinator.all_left and time.monotonic() < deadline:
                    time.sleep(0.01)
            coordinator.close()
        self._metrics.close()
        super().shutdown()

    # --- the loop ---

    def has_work(self) -> bool:
        return (
            self.scheduler.has_requests()
            or bool(self.batch_queue)
            or self._dummy_due()
            or self._awaiting_group_exit()
        )

    def _dummy_due(self) -> bool:
        # A sleeping rank runs no passes; the group is paused while it sleeps
        # (sleep pauses first), so it owes none unless a peer broke the pause,
        # which the progress watch reports.
        return self.step_sync.steps_owed > 0 and not self.model_executor.is_sleeping

    def _locally_drained(self) -> bool:
        return not self.scheduler.has_requests() and not self.batch_queue

    def _awaiting_group_exit(self) -> bool:
        """Shutting down: stay in the loop until every rank agreed on the
        last step and this rank ran it, or the wait for the peers ran out."""
        if self.is_running() or self._left_alone:
            return False
        group = self.step_sync.group
        if (
            group.phase == GroupPhase.EXITING
            and self.step_sync.local_step >= group.phase_step
        ):
            return False
        waited = (
            0.0
            if self._leaving_since is None
            else time.monotonic() - self._leaving_since
        )
        if waited > self._leave_wait_s():
            logger.warning(
                "step sync: dp_rank=%d leaves the DP group alone: the peers did not "
                "shut down within %.0fs; the group ends here",
                self.dp_rank,
                waited,
            )
            self._left_alone = True
            return False
        return True

    def _leave_wait_s(self) -> float:
        return max(float(self.vllm_config.shutdown_timeout), EXIT_GRACE_S)

    def _schedule_and_account(self, *args, **kwargs) -> SchedulerOutput:
        scheduler_output = self._upstream_schedule(*args, **kwargs)
        if scheduler_output.total_num_scheduled_tokens > 0:
            self.step_counter = self.step_sync.begin_forward(
                dummy=False, passes_after=self._passes_after(scheduler_output)
            )
        return scheduler_output

    def _passes_after(self, scheduler_output: SchedulerOutput) -> int | None:
        """The adaptive look-ahead's bound (work_bound.py); None when unknown."""
        scheduler = self.scheduler
        if not isinstance(scheduler, Scheduler):
            return None
        return passes_after_this(
            scheduler.running,
            scheduler.get_request_counts()[1],
            scheduler_output.num_scheduled_tokens,
        )

    @fault_tolerant_wrapper
    def run_busy_loop(self):
        """Run real passes when scheduled, dummy passes while owed, else block."""
        self.step_sync.watch_progress = True
        while self._handle_shutdown():
            self._process_input_queue()
            self._maybe_publish_request_counts()
            executed = self._process_engine_step()
            if not executed and self._dummy_due():
                self.step_counter = self.step_sync.begin_forward(dummy=True)
                self.execute_dummy_batch()
            self._report_drained()
            self._maybe_publish_request_counts()
            self._metrics.maybe_write()
        raise SystemExit

    def _process_input_queue(self):
        if not self.has_work():
            # About to block: publish the state the group settled at.
            self._metrics.maybe_write(force=True)
        elif (
            not self.is_running() and self._locally_drained() and not self._dummy_due()
        ):
            # Shutting down with nothing to run but the group's decision to
            # come: wait for it (upstream's loop does not block once
            # shutdown was requested).
            self._report_drained()
            with contextlib.suppress(queue.Empty):
                self._handle_client_request(
                    *self.input_queue.get(timeout=SHUTDOWN_POLL_S)
                )
        super()._process_input_queue()

    def _report_drained(self) -> None:
        """Tell the group when this rank will run no more real passes."""
        if not self._locally_drained():
            return
        if self.pause_phase == PausePhase.PAUSING and not self._pause_reported:
            self.step_sync.set_pause_ready()
            self._pause_reported = True
            # The group may have paused already (this rank re-paused before
            # its resume counted): then nothing new will arrive.
            self._on_group_state()
        if not self.is_running() and self._leaving_since is None:
            self.step_sync.set_leaving()
            self._leaving_since = time.monotonic()

    def _handle_client_request(self, request_type: Any, request: Any) -> None:
        if request_type is StepSyncInput.GRANT:
            self.step_sync.observe_grant(request)
            logger.debug(
                "step sync: dp_rank=%d grant coord_step=%d local_step=%d",
                self.dp_rank,
                self.step_sync.coord_step,
                self.step_sync.local_step,
            )
        elif request_type is StepSyncInput.GROUP:
            self._on_group_state()
        elif request_type is StepSyncInput.FAILED:
            raise StepSyncFailure(f"DP rank {self.dp_rank}: {request}")
        elif request_type == EngineCoreRequestType.START_DP_WAVE:
            self.wave_audit.start_dp_wave_received += 1
            logger.warning_once(
                "step sync: ignoring START_DP_WAVE (waves are not used)"
            )
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
            self.step_sync.request_ahead(
                passes_for_new(
                    request, self.vllm_config.scheduler_config.max_num_batched_tokens
                )
            )

    def _has_global_unfinished_reqs(self, local_unfinished: bool) -> bool:
        raise AssertionError("step sync DP engines never all-reduce in the busy loop")

    # --- pause as a group phase ---

    def _pause_complete(self) -> bool:
        """pause_scheduler() set the local pause state; the pause completes
        (idle callbacks run) only once the whole group stopped at one step."""
        if self.pause_phase in (PausePhase.RUNNING, PausePhase.RESUMING):
            # A resume still waiting for the group is superseded: answered.
            self._settle_resume()
            self.pause_phase = PausePhase.PAUSING
            self._pause_reported = False
            self._pause_intent = self.step_sync.set_pause_intent(True)
        self._report_drained()
        self._on_group_state()
        return self.pause_phase == PausePhase.PAUSED and not self.has_work()

    def _notify_idle_state_callbacks(self) -> None:
        if self.pause_phase == PausePhase.PAUSING:
            return  # idle here, but the group has not agreed on the last step
        super()._notify_idle_state_callbacks()

    def _on_group_state(self) -> None:
        """Apply the group's phase to this rank's pause phase. Only a state
        that acknowledges this rank's latest pause/resume call counts, so a
        stale one (sent before the call reached the coordinator) never
        completes it."""
        state = self.step_sync.group
        if state is None or state.intent_ack != self._pause_intent:
            return
        if (
            self.pause_phase == PausePhase.PAUSING
            and self._pause_reported
            and state.phase == GroupPhase.PAUSED
        ):
            self.step_sync.observe_grant(state.phase_step)
            self.pause_phase = PausePhase.PAUSED
            logger.info(
                "step sync: dp_rank=%d group paused at step %d (local %d)",
                self.dp_rank,
                state.phase_step,
                self.step_sync.local_step,
            )
        elif (
            self.pause_phase == PausePhase.RESUMING
            and state.phase == GroupPhase.RUNNING
        ):
            self.pause_phase = PausePhase.RUNNING
            EngineCoreProc.resume_scheduler(self)
            logger.info("step sync: dp_rank=%d group resumed", self.dp_rank)
            self._settle_resume()

    def _settle_resume(self) -> None:
        resumed, self._resumed = self._resumed, None
        if resumed is not None and not resumed.done():
            resumed.set_result(None)

    def resume_scheduler(self) -> Future | None:
        """Resume with the group: the answer (a future, as upstream's pause
        answers) comes once every rank runs again, so a client that awaited
        resume_generation() finds no engine paused (upstream's consensus
        is_scheduler_paused())."""
        if self.pause_phase == PausePhase.PAUSING:
            raise RuntimeError(
                "resume_scheduler called while pause is still in flight. "
                "Wait for the pause future to resolve before resuming."
            )
        if self.pause_phase != PausePhase.PAUSED:
            logger.debug("Resume called while engines are not paused, ignoring.")
            return
        if self.model_executor.is_sleeping:
            # Its peers would need passes it cannot run.
            raise RuntimeError(
                "resume_scheduler called while this DP rank is asleep; call wake_up "
                "instead"
            )
        # Scheduling restarts when every rank has resumed.
        self.pause_phase = PausePhase.RESUMING
        self._pause_intent = self.step_sync.set_pause_intent(False)
        self._settle_resume()
        resumed = self._resumed = Future()
        self._on_group_state()
        return resumed

    def is_scheduler_paused(self) -> bool:
        return self.pause_phase != PausePhase.RUNNING or super().is_scheduler_paused()

    # --- observability ---

    def _metrics_snapshot(self) -> dict[str, int]:
        stats: dict[str, int] = dict(self.step_sync.stats)
        if self.step_sync_coordinator is not None:
            stats.update(
                {
                    f"coordinator_{k}": v
                    for k, v in self.step_sync_coordinator.stats.items()
                }
            )
        stats.update(self.wave_audit.as_dict())
        return stats


__all__ = [
    "StepSyncDPEngineCoreProc",
    "StepSyncFailure",
]
