"""The P2P engine: one per worker, moves KV blocks to and from peer workers.

Control plane: a ZMQ ROUTER socket bound at this worker's port (the listener
thread) and one DEALER socket per peer (owned by that peer's thread). Data
plane: a :class:`~.transport.base.Transport` channel per (sender, receiver)
pair, created lazily on first contact and reused; each channel carries data
in one direction, from the side that created it.

One transfer, whatever the send mode, is always the same exchange, started by
the side that holds the KV (the *sender*):

1. ``Offer(key, num_blocks)`` on the control plane;
2. the receiver reserves room (receive buffer, else the host pool), queues the
   expectation on the channel's receive thread and replies with how many
   leading blocks it already holds (``skip_blocks``: its own prefix cache), or
   ``no_space`` / ``not_wanted``;
3. the sender writes the blocks ``[skip_blocks:]`` of every layer in data
   messages of one or more whole layers (``protocol.layer_groups``, which
   both sides compute); in PUT_ASYNC it writes a run of layers as soon as
   the forward pass has computed its last.

GET only adds a step 0: the decode side asks the prefill side (``Get``) to
make the offer now. Because each channel direction has one sending thread that
finishes one transfer before offering the next, and the receiver queues
expectations in the order it accepts offers, the n-th message on a channel
always belongs to the n-th accepted offer: no tags are needed, which is what
NCCL requires.

Every wait has a deadline. A failed channel is closed and every transfer
queued on it fails; the next transfer sets up a new one. A receive that does
not complete by its deadline is reported by the worker as a load failure, and
vLLM recomputes (``kv_load_failure_policy``).

Threads never touch the KV cache of a request they do not own: the sender
reads blocks that stay allocated (delayed free) until the worker reports the
send finished; the receiver writes only into its own buffer, and the model
thread copies the buffer into the KV cache (:meth:`P2pEngine.copy_into_cache`).

The pieces, one concern a module:

* ``layout.py``: the local KV cache as blocks of bytes (:class:`KVLayout`).
* ``core.py``: :class:`P2pEngine`, composed of its two sides, the peer
  threads and the listener; the worker's API.
* ``receiver.py`` / ``sender.py``: the :class:`Receiver` and :class:`Sender`
  it composes, each driving one table of the transfer core
  (``../recv_state.py``, ``../send_state.py``: one explicit state per key
  or transfer, pure decisions); ``room.py``: the receive buffer and pool.
* ``inbound.py``: a peer's channel to us and its receive thread; ``peer.py``:
  the thread that runs what we ask of one peer (offers, data, Gets). Both
  talk to the engine only through ``ports.py`` (typed Protocols).
* ``transfers.py``: one transfer on each side (:class:`SendTransfer`,
  :class:`RecvSlot`); ``local.py``: this worker as every part sees it.
* ``limits.py``: every interval, timeout and cap, read at use time.
"""

from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.engine.core import (
    P2pEngine,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.engine.layout import (
    KVLayout,
    check_compatible,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.engine.peer import (
    zmq_endpoint,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.engine.transfers import (
    RecvSlot,
    SendTransfer,
    SlotState,
)

__all__ = [
    "KVLayout",
    "P2pEngine",
    "RecvSlot",
    "SendTransfer",
    "SlotState",
    "check_compatible",
    "zmq_endpoint",
]
