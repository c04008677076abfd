"""The engine's intervals, timeouts and caps, in one table.

The engine's modules read them as ``limits.NAME`` at the moment they are used,
so a test that patches one here (``monkeypatch.setattr(limits, ...)``) changes
it for every module of the engine, the way vLLM's ``envs`` are read.
"""

from vllm_disagg.wire import clocks

POLL_INTERVAL_S = 0.05
GET_RETRY_INTERVAL_S = 0.05
# An idle receive thread checks this often whether its sender hung up.
IDLE_CHECK_INTERVAL_S = 1.0
# A peer thread with nothing to do for this long exits and frees its socket
# and channel (a new one is made on the next transfer to that peer).
PEER_IDLE_S = 60.0
# Inbound channels (one receive thread each) at most; Hellos beyond are refused.
MAX_INBOUND_CHANNELS = 256
# After prefill accepted a Get, decode asks again this often while no offer
# has come: prefill answers "ok" while its send is under way and "gone" once
# it ended (sent or failed), so a send that failed before its offer reached
# decode fails the load now, not at kv_load_timeout_s.
GET_CONFIRM_INTERVAL_S = 1.0
# A live peer answers a control message in milliseconds (0.72 s was the worst
# seen on a loaded 2-core machine); waiting the whole kv_hold_timeout_s for a
# dead one held every transfer queued behind it.
CONTROL_REPLY_TIMEOUT_S = 10.0
# After a peer left a control message unanswered, transfers to it fail at
# once for this long instead of each waiting CONTROL_REPLY_TIMEOUT_S again.
PEER_RETRY_AFTER_S = 5.0
# A Hello is accepted only this close to its sender's clock (replays of a
# captured one are refused: its channel id is remembered twice as long). The
# fleet's one clock rule (wire/clocks.py): twice what a router accepts at
# registration plus slack, so every pair a router makes can talk.
MAX_HELLO_AGE_S = clocks.MAX_HELLO_AGE_S
# An accepted Hello's data connection must be made this soon (the sender
# connects right after the reply); until then its thread counts as busy.
CHANNEL_SETUP_TIMEOUT_S = 15.0
# Receive-side keys tracked at most (expected, receiving, ready, closed).
MAX_RECV_KEYS = 65536
# How long a GET answered "released" is remembered, so a late Get gets "gone".
TOMBSTONE_TTL_S = 300.0
LOG_INTERVAL_S = 10.0
# Aborts of keys a decode does not know yet, remembered at most (a flood
# cannot grow the table; a forgotten one costs a kv_load_timeout_s wait).
MAX_EARLY_ABORTS = 4096
# A sender that gave up on a transfer tells the receiver (Abort); it waits
# this long for the answer and asks again after PEER_RETRY_AFTER_S, until
# the transfer's own deadline.
ABORT_REPLY_TIMEOUT_S = 2.0
# How long close() lets the peer threads end their sends and tell the
# receivers (Aborts) before it stops them.
CLOSE_FLUSH_S = 1.0
