"""Protocol transcripts: commands in, every transition and message out.

A transcript (``tests/transcripts/<core>/*.txt``) drives one socket-free protocol
core with a script and records, after each command, what it produced. The format
is that of etcd raft's datadriven testdata::

    # Comments and blank lines are kept as they are.
    command arg key=value
    ----
    one line per transition or message the command produced

The output block ends at the next blank line (a command that produced nothing
has an empty block). Output is deterministic: time is a number the script
advances, messages are rendered field by field (no MACs, no object ids), and
lines come in the order the core produced them.

``run_transcript(text, driver)`` replays a file and returns it with the output
blocks the core produces now; the test compares that with the file and shows a
unified diff, or, with ``--rewrite-transcripts``, writes it back, so a change of
behaviour is reviewed as a diff of the transcripts.

A driver per core (``DRIVERS``) turns one command into calls on the real core,
doing what the core's shell does around it (a participant's network thread
ticks after every change; a receiver applies an accepted offer).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field

from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.recv_state import (
    Event,
    OfferAnswer,
    OfferFacts,
    RecvState,
    RecvTable,
    Timeouts,
    TransitionError,
    decide_offer,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.send_state import (
    NOT_SENT_IN_TIME,
    GetAnswer,
    SendEvent,
    SendState,
    SendTable,
    decide_get,
)
from vllm_disagg.v1.engine.step_sync import (
    TO_COORDINATOR,
    TO_PARTICIPANT,
    Abort,
    CoordinatorCore,
    GroupState,
    ParticipantCore,
    RankState,
    StepSyncConfig,
    seal,
)

SEPARATOR = "----"


class TranscriptError(ValueError):
    """A script the driver cannot run (a bug in the transcript, not the core)."""


# --- the file format ------------------------------------------------------------


@dataclass
class Case:
    prose: list[str]  # comment and blank lines before the command, kept verbatim
    command: str
    output: list[str]
    line: int  # of the command, 1-based


def parse(text: str) -> tuple[list[Case], list[str]]:
    """The cases of a transcript, and the prose after the last one."""
    lines = text.splitlines()
    cases: list[Case] = []
    prose: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if not line.strip() or line.startswith("#"):
            prose.append(line)
            i += 1
            continue
        if i + 1 >= len(lines) or lines[i + 1] != SEPARATOR:
            raise TranscriptError(
                f"line {i + 2}: expected {SEPARATOR!r} after {line!r}"
            )
        j = i + 2
        while j < len(lines) and lines[j].strip():
            j += 1
        cases.append(Case(prose, line, lines[i + 2 : j], i + 1))
        prose = []
        i = j + 1  # the blank line that ends the block is the block's
    return cases, prose


def render(cases: list[Case], trailing: list[str]) -> str:
    out: list[str] = []
    for case in cases:
        out += [*case.prose, case.command, SEPARATOR, *case.output, ""]
    out += trailing
    while out and not out[-1].strip():
        out.pop()
    return "\n".join(out) + "\n"


@dataclass
class Command:
    """``name arg... key=value...``; a driver reads what it needs, and an option
    it did not read is an error (a typo must not pass silently)."""

    name: str
    args: list[str]
    opts: dict[str, str]
    _read: set[str] = field(default_factory=set)

    @classmethod
    def parse(cls, line: str) -> Command:
        words = shlex.split(line)
        args = [w for w in words[1:] if "=" not in w]
        opts = dict(w.split("=", 1) for w in words[1:] if "=" in w)
        return cls(words[0], args, opts)

    def opt(self, key: str, default=None, kind=str):
        self._read.add(key)
        if key not in self.opts:
            if default is None:
                raise TranscriptError(f"{self.name}: needs {key}=")
            return default
        return kind(self.opts[key])

    def arg(self, index: int, kind=str):
        if index >= len(self.args):
            raise TranscriptError(f"{self.name}: needs argument {index + 1}")
        return kind(self.args[index])

    def unread(self) -> list[str]:
        return sorted(set(self.opts) - self._read)


def run_transcript(text: str, driver) -> str:
    """``text`` with every output block replaced by what ``driver`` produces."""
    cases, trailing = parse(text)
    for case in cases:
        cmd = Command.parse(case.command)
        try:
            case.output = driver.run(cmd)
            if cmd.unread():
                raise TranscriptError(f"unknown options {cmd.unread()}")
        except TranscriptError as e:
            raise TranscriptError(f"line {case.line}: {case.command!r}: {e}") from e
    return render(cases, trailing)


def _num(value: float) -> str:
    return f"{round(value, 6):g}"


def _changes(who: str, before: dict, after: dict) -> list[str]:
    """``who: name old -> new, ...`` for the values that changed (None: absent,
    shown ``-``); ``who: forgotten`` when the party is gone."""
    if before and not after:
        return [f"{who}: forgotten"]
    names = list(after) + [n for n in before if n not in after]
    changed = [
        f"{n} {before.get(n) or '-'} -> {after.get(n) or '-'}"
        for n in names
        if before.get(n) != after.get(n)
    ]
    return [f"{who}: {', '.join(changed)}"] if changed else []


class Driver:
    """Dispatches ``name`` to ``cmd_<name>``; ``now`` is the script's clock."""

    def __init__(self):
        self.now = 0.0
        self.mark: dict = {}

    def run(self, cmd: Command) -> list[str]:
        method = getattr(self, f"cmd_{cmd.name}", None)
        if method is None:
            raise TranscriptError(f"unknown command {cmd.name!r}")
        self.mark = self.snapshot()
        out = method(cmd) or []
        return out + self.transitions()

    def snapshot(self) -> dict[str, dict[str, str | None]]:
        """What is rendered of each party's state: {party: {name: value}}."""
        raise NotImplementedError

    def transitions(self) -> list[str]:
        """The changes since the last call (or the command's start)."""
        before, after = self.mark, self.snapshot()
        self.mark = after
        lines = []
        for who in sorted(before.keys() | after.keys()):
            lines += _changes(who, before.get(who, {}), after.get(who, {}))
        return lines

    def advance(self, cmd: Command) -> None:
        self.now = round(self.now + cmd.arg(0, float), 6)


# --- step sync ------------------------------------------------------------------

_SECRET = b"transcripts: the group key......"  # 32 bytes; frames are sealed with it
_FLAGS = ("want_pause", "pause_ready", "leaving", "left")


def _message(msg) -> str:
    if isinstance(msg, RankState):
        flags = [f for f in _FLAGS if getattr(msg, f)]
        return (
            f"rank seq={msg.seq} requested={msg.requested} local={msg.local_step} "
            f"intent={msg.intent}" + "".join(f" {f}" for f in flags)
        )
    if isinstance(msg, GroupState):
        return (
            f"group seq={msg.seq} step={msg.step} {msg.phase.name}@{msg.phase_step} "
            f"members={msg.members} ack={msg.ack_seq} intent_ack={msg.intent_ack}"
        )
    assert isinstance(msg, Abort)
    return f"abort seq={msg.seq} {msg.reason!r}"


@dataclass
class _Packet:
    src: int | None  # a rank; None: the coordinator
    dst: int | None
    frames: list[bytes]  # sealed, as on the wire


class StepSyncDriver(Driver):
    """A coordinator core and ``dp`` participant cores on an in-memory network
    that holds every message until ``deliver``.

    Commands::

        group dp=2 lookahead=2 timeout=1   # the cores (the coordinator starts)
        rank N start|request|forward|dummy|pause|resume|drained|leaving|left|silent
        rank N request|forward passes=K     # the work can use at most K passes
        deliver [to=coord|N]               # what is in flight now, in order
        stabilize                          # deliver until nothing is in flight
        tick DT [times=K] [deliver=1]      # advance the clock; every core ticks
        close REASON                       # the coordinator shuts down

    An engine command is followed by the participant's tick, as its network
    thread wakes on every change; so is every frame it receives. A silent rank
    neither ticks nor reads: its process hangs. Each message is shown when
    sent, each core's transitions after the call that made them.
    """

    def __init__(self):
        super().__init__()
        self.coord: CoordinatorCore | None = None
        self.ranks: dict[int, ParticipantCore] = {}
        self.silent: set[int] = set()
        self.wire: list[_Packet] = []

    def snapshot(self) -> dict:
        if self.coord is None:
            return {}
        c = self.coord
        counters = c.counters.snapshot()
        state = {
            "coord": {
                "step": str(c.step),
                "phase": f"{c.phase.name}@{c.phase_step}",
                "members": ",".join(map(str, c.registered)),
                "failed": repr(c.failed) if c.failed else None,
                **{
                    k: str(v)
                    for k, v in counters.items()
                    if v and k.endswith(("_messages", "_violations"))
                },
            }
        }
        for r, p in self.ranks.items():
            group = p.group
            state[f"rank {r}"] = {
                "local": str(p.local_step),
                "requested": str(p.requested),
                "granted": str(p.coord_step),
                "phase": group and f"{group.phase.name}@{group.phase_step}",
                "members": group and str(group.members),
                "failed": repr(p.failed) if p.failed else None,
            }
        return state

    def _send(self, src: int | None, dst: int | None, msg) -> str:
        codec = TO_COORDINATOR if dst is None else TO_PARTICIPANT
        self.wire.append(_Packet(src, dst, seal(_SECRET, codec, msg)))
        name = {None: "coord"}
        return (
            f"{name.get(src, f'rank {src}')} -> {name.get(dst, f'rank {dst}')}: "
            f"{_message(msg)}"
        )

    def _after(self, sends: list[tuple[int | None, object]], src) -> list[str]:
        """A core's transitions, then what it sent."""
        return self.transitions() + [self._send(src, dst, m) for dst, m in sends]

    def _coord(self, sends) -> list[str]:
        return self._after([(int(route[1:]), m) for route, m in sends], None)

    def _rank_tick(self, r: int) -> list[str]:
        msg = self.ranks[r].on_tick(self.now)
        return self._after([] if msg is None else [(None, msg)], r)

    def cmd_group(self, cmd: Command) -> list[str]:
        config = StepSyncConfig(
            dp_size=cmd.opt("dp", kind=int),
            lookahead=cmd.opt("lookahead", 2, int),
            peer_timeout_s=cmd.opt("timeout", 1.0, float),
        )
        self.coord = CoordinatorCore(config, _SECRET)
        self.coord.start(self.now)
        self.ranks = {
            r: ParticipantCore(config, r, f"incarnation-{r}", _SECRET)
            for r in range(config.dp_size)
        }
        self.mark = self.snapshot()
        return [
            f"coord: heartbeat every {_num(config.heartbeat_interval_s)}s, "
            f"peers dead after {_num(config.peer_timeout_s)}s"
        ]

    def cmd_rank(self, cmd: Command) -> list[str]:
        r, verb = cmd.arg(0, int), cmd.arg(1)
        part = self.ranks[r]
        if verb == "start":
            return self._after([(None, part.start(self.now))], r)
        if verb == "silent":
            self.silent.add(r)
            return [f"rank {r}: silent from now on (neither reads nor sends)"]
        # passes=K: the most passes the rank's known work can use (with request,
        # all of it; with forward, after this pass); absent: unknown.
        passes = cmd.opt("passes", -1, int) if verb in ("request", "forward") else -1
        passes = None if passes < 0 else passes
        actions = {
            "request": lambda: part.request_ahead(passes),
            "forward": lambda: part.begin_forward(dummy=False, passes_after=passes),
            "dummy": lambda: part.begin_forward(dummy=True),
            "pause": lambda: part.set_pause_intent(True),
            "resume": lambda: part.set_pause_intent(False),
            "drained": part.set_pause_ready,
            "leaving": part.set_leaving,
            "left": part.set_left,
        }
        if verb not in actions:
            raise TranscriptError(f"unknown rank command {verb!r}")
        actions[verb]()
        return self._rank_tick(r)

    def _deliver(self, packet: _Packet) -> list[str]:
        if packet.dst is None:
            route = f"r{packet.src}".encode()
            return self._coord(self.coord.on_frames([route, *packet.frames], self.now))
        if packet.dst in self.silent:
            return []
        part = self.ranks[packet.dst]
        received = part.on_frames(packet.frames, self.now)
        if received is not None and received.grant is not None:
            part.observe_grant(received.grant)  # what the engine does with it
        return self._rank_tick(packet.dst)

    def cmd_deliver(self, cmd: Command) -> list[str]:
        to = cmd.opt("to", "all")
        flying, self.wire, out = self.wire, [], []
        for packet in flying:
            dst = "coord" if packet.dst is None else str(packet.dst)
            if to in ("all", dst):
                out += self._deliver(packet)
            else:
                self.wire.append(packet)
        return out

    def cmd_stabilize(self, cmd: Command) -> list[str]:
        out = []
        for _ in range(100):
            if not self.wire:
                return out
            out += self.cmd_deliver(Command("deliver", [], {}))
        raise TranscriptError("still messages in flight after 100 rounds")

    def cmd_tick(self, cmd: Command) -> list[str]:
        times, deliver = cmd.opt("times", 1, int), cmd.opt("deliver", 0, int)
        out = []
        for _ in range(times):
            self.advance(cmd)
            lines = self._coord(self.coord.on_tick(self.now))
            for r in self.ranks:
                if r not in self.silent:
                    lines += self._rank_tick(r)
            if deliver:
                lines += self.cmd_stabilize(cmd)
            out += [f"t={_num(self.now)}", *("  " + line for line in lines)]
        return out

    def cmd_close(self, cmd: Command) -> list[str]:
        return self._coord(self.coord.on_close(" ".join(cmd.args)))


# --- P2P: the receive side ------------------------------------------------------


@dataclass
class _Slot:
    """The room an accepted offer took (RecvSlot's part the table looks at)."""

    blocks: int
    nbytes: int
    reason: str = ""  # a failed slot's: what the decode's poll hears

    def render(self) -> str:
        return "failed" if self.reason else f"{self.blocks} blocks"


class RecvDriver(Driver):
    """A :class:`RecvTable` and :func:`decide_offer`, driven as the receiver
    (engine/receiver.py) drives them.

    Commands::

        timeouts hold=60 grace=5 closed=300
        expect KEY deadline=T digest=HEX [skip=N] [prefill=HOST]
        offer KEY blocks=N digest=HEX [from=HOST] [channel=ok|unknown]
              [max_blocks=N] [table_full=1]
        received KEY | failed KEY reason=...   # the receive thread ends
        take KEY                               # the worker's poll()
        abandon KEY                            # the worker stops waiting
        tick DT                                # advance the clock; the sweep runs
    """

    def __init__(self):
        super().__init__()
        self.table = RecvTable(Timeouts(hold_s=60.0))

    def snapshot(self) -> dict:
        return {
            key: {
                "state": e.state.name if e.state else None,
                "until": _num(e.deadline),
                "expected": "yes" if e.expected else None,
                "slot": e.slot and e.slot.render(),
                "reason": repr(e.reason) if e.reason else None,
            }
            for key, e in self.table.keys.items()
        }

    def _apply(self, key: str, event: Event, **kw) -> list[str]:
        try:
            self.table.apply(key, event, self.now, **kw)
        except TransitionError as e:
            return [f"error: {e}"]
        return []

    def cmd_timeouts(self, cmd: Command) -> None:
        self.table = RecvTable(
            Timeouts(
                hold_s=cmd.opt("hold", 60.0, float),
                grace_s=cmd.opt("grace", 5.0, float),
                closed_s=cmd.opt("closed", 300.0, float),
            )
        )

    def cmd_expect(self, cmd: Command) -> list[str]:
        key, deadline = cmd.arg(0), cmd.opt("deadline", kind=float)
        out = self._apply(key, Event.EXPECT, deadline=deadline)
        entry = self.table.get(key)
        entry.skip_blocks = cmd.opt("skip", 0, int)
        entry.prompt_digest = bytes.fromhex(cmd.opt("digest"))
        entry.load_deadline = deadline
        entry.prefill_host = cmd.opt("prefill", "")
        return out

    def cmd_offer(self, cmd: Command) -> list[str]:
        key = cmd.arg(0)
        facts = OfferFacts(
            key=key,
            num_blocks=cmd.opt("blocks", kind=int),
            prompt_digest=bytes.fromhex(cmd.opt("digest")),
            channel="ch-1",
            channel_ok=cmd.opt("channel", "ok") == "ok",
            offered_by=cmd.opt("from", ""),
            max_blocks=cmd.opt("max_blocks", 1024, int),
            table_full=bool(cmd.opt("table_full", 0, int)),
        )
        d = decide_offer(self.table.get(key), facts)
        if d.answer is OfferAnswer.REFUSE:
            line = f"offer {key}: refuse {d.refusal.name} ({d.detail})"
            if not d.fail_load:
                return [line]
            # receiver.fail_key: no other KV will come; the load fails now
            return [line + ", the load fails", *self._fail(key, "digest mismatch")]
        if d.answer is OfferAnswer.NOT_WANTED:
            return [f"offer {key}: not_wanted"]
        deadline = d.deadline
        if deadline is None:  # nobody expects it yet: held at most hold_s
            deadline = self.now + self.table.timeouts.hold_s
        skip = d.skip_blocks
        out = [f"offer {key}: accept skip={skip} receive by {_num(deadline)}"]
        out += self._apply(key, Event.OFFER, deadline=deadline)
        self.table.get(key).slot = _Slot(facts.num_blocks - skip, 1)
        return out

    def cmd_received(self, cmd: Command) -> list[str]:
        return self._apply(cmd.arg(0), Event.RECEIVED)

    def _fail(self, key: str, reason: str) -> list[str]:
        """FAILED, and the slot that tells the decode's poll why."""
        out = self._apply(key, Event.FAILED)
        entry = self.table.get(key)
        if not out and entry.state is RecvState.READY:
            entry.reason, entry.slot = reason, _Slot(0, 0, reason)
        return out

    def cmd_failed(self, cmd: Command) -> list[str]:
        return self._fail(cmd.arg(0), cmd.opt("reason"))

    def cmd_take(self, cmd: Command) -> list[str]:
        key = cmd.arg(0)
        entry = self.table.get(key)
        if entry is None or entry.state is not RecvState.READY:
            return [f"take {key}: nothing yet"]
        slot = entry.slot
        self._apply(key, Event.TAKEN)
        entry.slot = None
        what = f"failed: {slot.reason}" if slot.reason else f"{slot.blocks} blocks"
        return [f"take {key}: {what}"]

    def cmd_abandon(self, cmd: Command) -> list[str]:
        key = cmd.arg(0)
        before = self.table.state(key)
        out = self._apply(key, Event.ABANDON)
        if before is RecvState.READY:
            self.table.get(key).slot = None
            out.append(f"abandon {key}: slot freed")
        return out

    def cmd_tick(self, cmd: Command) -> list[str]:
        self.advance(cmd)
        freed = self.table.expire(self.now)
        for entry in freed:
            entry.slot = None
        return [f"t={_num(self.now)}"] + [
            f"{e.key}: unclaimed, slot freed" for e in freed
        ]


# --- P2P: the send side ---------------------------------------------------------


@dataclass(eq=False)
class _Transfer:
    name: str  # KEY#N: the N-th transfer of KEY in this transcript
    key: str
    deadline: float
    decode_host: str
    state: SendState | None = None


class SendDriver(Driver):
    """A :class:`SendTable` and :func:`decide_get`, driven as the sender
    (engine/sender.py) drives them.

    Commands::

        tombstone S                    # how long a released key answers gone
        hold KEY deadline=T [for=HOST] # the prefill keeps KV for a Get
        get KEY from=HOST              # a decode's Get
        sent KEY | fail KEY            # the pulled send ends
        tick DT                        # advance the clock; the sweep runs
    """

    def __init__(self):
        super().__init__()
        self.table = SendTable(300.0)
        self.transfers: list[_Transfer] = []

    def snapshot(self) -> dict:
        state = {x.name: {"state": x.state and x.state.name} for x in self.transfers}
        for key, filed in self.table.keys.items():
            state[f"table {key}"] = {
                "filed": filed.xfer.name,
                "until": _num(filed.until),
            }
        return state

    def cmd_tombstone(self, cmd: Command) -> None:
        self.table = SendTable(cmd.arg(0, float))

    def cmd_hold(self, cmd: Command) -> list[str]:
        key = cmd.arg(0)
        n = sum(x.key == key for x in self.transfers) + 1
        xfer = _Transfer(
            f"{key}#{n}", key, cmd.opt("deadline", kind=float), cmd.opt("for", "")
        )
        self.transfers.append(xfer)
        replaced = self.table.hold(xfer, self.now)
        if replaced is None:
            return []
        # sender.finish: nothing could ever pull the one it replaced
        self.table.apply(replaced, SendEvent.FAIL, self.now)
        return [f"{replaced.name}: replaced by {xfer.name}, fails"]

    def cmd_get(self, cmd: Command) -> list[str]:
        key = cmd.arg(0)
        xfer = self.table.get(key)
        answer = decide_get(xfer, cmd.opt("from"))
        if answer is GetAnswer.PULL:
            self.table.apply(xfer, SendEvent.PULL, self.now)
        return [f"get {key}: {answer.value}"]

    def _end(self, cmd: Command, event: SendEvent) -> list[str]:
        key = cmd.arg(0)
        xfer = self.table.get(key)
        if xfer is None or not self.table.apply(xfer, event, self.now):
            return [f"{event.value} {key}: ignored (no transfer under way)"]
        return []

    def cmd_sent(self, cmd: Command) -> list[str]:
        return self._end(cmd, SendEvent.SENT)

    def cmd_fail(self, cmd: Command) -> list[str]:
        return self._end(cmd, SendEvent.FAIL)

    def cmd_tick(self, cmd: Command) -> list[str]:
        self.advance(cmd)
        expired = self.table.expire(self.now)
        return [f"t={_num(self.now)}"] + [
            f"{x.name}: ends: {NOT_SENT_IN_TIME}" for x in expired
        ]


# The transcript directories (tests/transcripts/<name>/) and their drivers.
DRIVERS = {
    "step_sync": StepSyncDriver,
    "p2p_recv": RecvDriver,
    "p2p_send": SendDriver,
}
