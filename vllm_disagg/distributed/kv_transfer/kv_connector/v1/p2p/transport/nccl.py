"""NCCL transport: device-to-device channels through vLLM's ``PyNcclCommunicator``.

A channel is two 2-rank communicators, one per direction. A single one
would be driven by the send and the receive thread at once: NCCL
communicators are not thread-safe, and NCCL serialises the operations of a
communicator, so a send queued before a receive on one side and after it on
the other would deadlock. The initiator is rank 0 in both and mints both
unique ids (the setup bytes); the acceptor is rank 1.

``ncclCommInitRank`` and NCCL kernels have no timeout, so set-up runs in a
thread waited on until the deadline, and every send/receive is enqueued on
the channel's own stream and then polled through a CUDA event against the
deadline (no unbounded ``synchronize``). A message is an int64 size header
then one flat uint8 device tensor (several parts are gathered with
``torch.cat`` / scattered from a buffer), since NCCL needs both sides to
post the same sizes. The receiver checks the header before posting the data
receive. NCCL needs one GPU per rank, so a channel needs two GPUs.

Nothing NCCL-related is imported until a transport is built, so this module
imports on CPU-only installs.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.transport.base import (
    AcceptFinish,
    Channel,
    InitiateFinish,
    Transport,
    TransportError,
    byte_views,
    call_before,
)

UNIQUE_ID_BYTES = 128
_SETUP_BYTES = 2 * UNIQUE_ID_BYTES  # initiator->acceptor id, acceptor->initiator id
_POLL_MIN_S = 20e-6
_POLL_MAX_S = 1e-3


def _communicators(setup: bytes, rank: int, device: torch.device, deadline: float):
    """Both communicators of a channel, in the same order on both ranks."""
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator

    def build():
        comms = []
        try:
            with torch.accelerator.device_index(device.index):
                for i in range(2):
                    uid = setup[i * UNIQUE_ID_BYTES : (i + 1) * UNIQUE_ID_BYTES]
                    comm = PyNcclCommunicator.from_unique_id_bytes(uid, rank, 2, device)
                    comms.append(comm)
                    if comm.disabled:
                        raise TransportError("pynccl is disabled (VLLM_DISABLE_PYNCCL)")
        except BaseException:
            for comm in comms:
                comm.destroy()
            raise
        return comms

    def discard(comms):
        for comm in comms:
            comm.destroy()

    return call_before(deadline, "nccl communicator set-up", build, discard)


class NcclChannel(Channel):
    def __init__(self, comms, rank: int, device: torch.device):
        # comms[0] carries initiator -> acceptor, comms[1] the other way.
        self._send_comm, self._recv_comm = comms if rank == 0 else comms[::-1]
        self._peer = 1 - rank
        self._device = device
        self._send_stream = torch.cuda.Stream(device)
        self._recv_stream = torch.cuda.Stream(device)
        self._send_header = torch.zeros(1, dtype=torch.int64, device=device)
        self._recv_header = torch.zeros(1, dtype=torch.int64, device=device)
        self._recv_header_host = torch.zeros(1, dtype=torch.int64, pin_memory=True)
        # Buffers an operation that failed may still be using: kept until close.
        self._in_flight: list[torch.Tensor] = []
        self._error: str | None = None
        self._closed = False

    def send(self, tensors: Sequence[torch.Tensor], deadline: float) -> None:
        self._check()
        parts = byte_views(tensors, self._device)
        total = sum(p.numel() for p in parts)
        stream = self._send_stream
        stream.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(stream):
            flat = parts[0] if len(parts) == 1 else torch.cat(parts) if parts else None
            self._send_header.fill_(total)
            self._send_comm.send(self._send_header, self._peer, stream)
            if flat is not None:
                self._send_comm.send(flat, self._peer, stream)
        self._sync(stream, deadline, "send", flat)

    def recv(self, tensors: Sequence[torch.Tensor], deadline: float) -> None:
        self._check()
        parts = byte_views(tensors, self._device)
        expected = sum(p.numel() for p in parts)
        stream = self._recv_stream
        stream.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(stream):
            self._recv_comm.recv(self._recv_header, self._peer, stream)
            self._recv_header_host.copy_(self._recv_header, non_blocking=True)
        self._sync(stream, deadline, "recv", None)
        total = int(self._recv_header_host[0])
        if total != expected:
            raise self._fail(f"peer sent {total} bytes, receiver expects {expected}")
        if not total:
            return
        with torch.cuda.stream(stream):
            if len(parts) == 1:
                flat = parts[0]
            else:
                flat = torch.empty(total, dtype=torch.uint8, device=self._device)
            self._recv_comm.recv(flat, self._peer, stream)
            if len(parts) > 1:
                for part, chunk in zip(
                    parts, flat.split([p.numel() for p in parts]), strict=True
                ):
                    part.copy_(chunk)
        self._sync(stream, deadline, "recv", flat)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._error is None:
            self._error = "channel closed"
        # ncclCommAbort also ends kernels still waiting for the peer.
        self._send_comm.destroy()
        self._recv_comm.destroy()
        self._in_flight.clear()

    def _sync(
        self, stream, deadline: float, what: str, buffer: torch.Tensor | None
    ) -> None:
        """Wait for ``stream``'s work so far, polling so the deadline holds."""
        event = torch.cuda.Event()
        event.record(stream)
        delay = _POLL_MIN_S
        while not event.query():
            if self._closed or time.monotonic() >= deadline:
                if buffer is not None:
                    self._in_flight.append(buffer)
                reason = "channel closed" if self._closed else "deadline passed"
                raise self._fail(f"{what}: {reason}")
            time.sleep(delay)
            delay = min(2 * delay, _POLL_MAX_S)

    def _check(self) -> None:
        if self._error is not None:
            raise TransportError(self._error)

    def _fail(self, reason: str) -> TransportError:
        if self._error is None:
            self._error = reason
        return TransportError(self._error)


class NcclTransport(Transport):
    """Channels between GPUs (one per rank) over NCCL."""

    name = "nccl"
    receives_into_host = False

    def __init__(self, device: torch.device, bind_host: str):
        if device.type != "cuda" or not torch.cuda.is_available():
            raise TransportError(
                f"the nccl transport needs a CUDA device (got {device}, CUDA "
                f"{'available' if torch.cuda.is_available() else 'not available'}); "
                "use transport 'tcp' or 'gloo' on CPU"
            )
        if device.index is None:
            device = torch.device("cuda", torch.accelerator.current_device_index())
        super().__init__(device, bind_host)
        try:
            from vllm.distributed.device_communicators.pynccl_wrapper import NCCLLibrary

            self._nccl = NCCLLibrary()
        except Exception as e:
            raise TransportError(f"cannot load the NCCL library: {e}") from e

    def initiate(self, peer_host: str | None = None) -> tuple[bytes, InitiateFinish]:
        setup = b"".join(bytes(self._nccl.ncclGetUniqueId().internal) for _ in range(2))

        def finish(reply: bytes, deadline: float) -> Channel:
            if reply:
                raise TransportError(f"unexpected nccl reply of {len(reply)} bytes")
            return NcclChannel(
                _communicators(setup, 0, self.device, deadline), 0, self.device
            )

        return setup, finish

    def accept(
        self, setup: bytes, peer_host: str | None = None
    ) -> tuple[bytes, AcceptFinish]:
        if len(setup) != _SETUP_BYTES:
            raise TransportError(
                f"nccl setup must be {_SETUP_BYTES} bytes, got {len(setup)}"
            )
        setup = bytes(setup)
        return b"", lambda deadline: NcclChannel(
            _communicators(setup, 1, self.device, deadline), 1, self.device
        )
