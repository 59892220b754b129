"""Coordinator replicas share their relays through PostgreSQL's own broker: LISTEN/NOTIFY (psycopg).

A replica's line (``relay.Relay``) is held by the coordinator process it polls. With several processes
on one PostgreSQL database, each has a ``Broker``: it announces the leases whose replicas poll it on the
shared channel ``HOLDERS`` (throttled to one announcement per lease per ``ANNOUNCE_S``), and listens on
its own channel. A request reaching a process that holds none of the deployment's replicas is sent to
the holder's channel (``submit``); the holder places it on its replica as one of its own, and sends the
request's events back to the sender's channel, where the request's reader takes them as it would from a
local replica; a cancel goes the same way. A NOTIFY payload holds under 8,000 bytes, so a longer
message travels in parts, reassembled in order (one sending connection per process: PostgreSQL
delivers one session's notifications in the order they were committed).

Failover crosses processes: a replica lost on its holder is reported to the sender (``lost``), whose
request goes on on another live replica (held here or by any process) from the tokens it read; a holder
that dies stops announcing, so its leases go stale after ``HELD_S`` and the requests sent there move on
likewise (its replicas reconnect to another process: ``client.http``). Each connection reconnects
with backoff when PostgreSQL drops it (a restart, ``pg_terminate_backend``): the listening one LISTENs
again, the sending one sends again what it was sending; notifications sent while the listener was away
are lost (a request waiting on them fails after ``relay.SILENCE_S``; announcements come again within
one poll). Served rates are counted where the replica is.
"""

from __future__ import annotations

import json
import logging
import queue
import secrets
import threading
import time
from collections.abc import Collection, Iterator

import psycopg

from gpuflex.coordinator.relay import Relay, RemoteGeneration
from gpuflex.errors import ServiceError
from gpuflex.protocol.relay import RelayEvent, RelayRequest
from gpuflex.serve.sampling import SamplingParams

HOLDERS = "gpuflex_relay_holders"
ANNOUNCE_S = 2.0  # a lease is announced again at most this often (on its polls)
HELD_S = 15.0  # an announcement stands this long (a replica polls at least every 10 s)
PART = 3000  # characters of a message per notification (escaped, under PostgreSQL's 8,000 bytes)
RECONNECT_S = (0.1, 5.0)  # a dropped connection is opened again after this, doubling up to the second
LISTENER, SENDER = "gpuflex-relay-listen", "gpuflex-relay-send"  # the connections' application_name

log = logging.getLogger("gpuflex.broker")


class Broker:
    """This process's end of the broker; ``dsn``: the database's, as psycopg reads it."""

    def __init__(self, dsn: str, relay: Relay):
        self.relay = relay
        self.channel = f"gpuflex_relay_{secrets.token_hex(8)}"
        self._dsn = dsn
        self._lock = threading.Lock()
        self._holders: dict[str, tuple[str, float]] = {}  # lease -> (its process's channel, heard at)
        self._announced: dict[str, float] = {}
        self._waiting: dict[str, RemoteGeneration] = {}  # request id -> its reader here
        self._serving: dict[str, RemoteGeneration] = {}  # request id -> served here for another
        self._parts: dict[str, list[str]] = {}
        self._batches: dict[str, list[dict]] = {}  # events waiting to be sent, by channel
        # (channel, payload); a payload of None: the channel's batch of events
        self._outbox: queue.SimpleQueue[tuple[str, str | None] | None] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        """Connect (listening before this returns: no announcement made from now on is missed)."""
        listening, sending = self._listening(), self._connect(SENDER)
        for target, conn in ((self._listen, listening), (self._send, sending)):
            thread = threading.Thread(target=target, args=(conn,), name="relay-broker", daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        self._stop.set()
        self._post(self.channel, {"t": "stop"})  # wakes the listener now
        self._outbox.put(None)
        for thread in self._threads:
            thread.join(timeout=5)

    # ------------------------------------------------------------------------------ the relay's calls

    def announce(self, lease_id: str) -> None:
        """A replica of ``lease_id`` polls this process (from the event loop: nothing blocks here); it
        left the process that held it before, if any (requests sent there move on: ``alive``)."""
        now = time.monotonic()
        with self._lock:
            self._holders.pop(lease_id, None)
        if now - self._announced.get(lease_id, -ANNOUNCE_S) >= ANNOUNCE_S:
            self._announced[lease_id] = now
            self._post(HOLDERS, {"t": "holds", "lease": lease_id, "at": self.channel})

    def holder(self, leases: Collection[str]) -> str | None:
        """The channel of another process that announced one of ``leases`` within ``HELD_S``."""
        now = time.monotonic()
        with self._lock:
            held = [self._holders[k] for k in sorted(leases) if k in self._holders]
        return next((channel for channel, at in held if now - at < HELD_S), None)

    def alive(self, channel: str) -> bool:
        """Whether the process of ``channel`` announced a replica within ``HELD_S`` (one that died does
        not; nor does one whose replicas all left it)."""
        now = time.monotonic()
        with self._lock:
            return any(c == channel and now - at < HELD_S for c, at in self._holders.values())

    def submit(self, generation: RemoteGeneration, channel: str) -> None:
        """Send the generation's request to the process of ``channel``, which places it on the replica
        with the fewest open among those of the generation's leases it holds; its events come back."""
        with self._lock:
            self._waiting[generation.request.id] = generation
        p = generation.params
        self._post(
            channel,
            {
                "t": "submit",
                "reply": self.channel,
                "leases": sorted(generation.leases - generation.lost),
                "deployment": generation.deployment_id,
                "request": generation.request.model_dump(mode="json"),
                "params": [p.temperature, p.top_p, p.max_tokens, list(p.stop), p.seed],
            },
        )

    def cancel(self, channel: str, request_id: str) -> None:
        with self._lock:
            self._waiting.pop(request_id, None)
        self._post(channel, {"t": "cancel", "id": request_id})

    # ---------------------------------------------------------------------------------- the threads

    def _post(self, channel: str, message: dict) -> None:
        for text in _notifications(message):
            self._outbox.put((channel, text))

    def _post_event(self, channel: str, event: RelayEvent) -> None:
        """Events for one channel go together: those queued while the sender is busy, in one message."""
        with self._lock:
            batch = self._batches.setdefault(channel, [])
            batch.append(event.model_dump(mode="json", exclude_none=True))
            first = len(batch) == 1
        if first:
            self._outbox.put((channel, None))

    def _send(self, conn: psycopg.Connection | None) -> None:
        waits = _backoff()
        while (item := self._outbox.get()) is not None:
            channel, text = item
            if text is None:
                with self._lock:
                    events = self._batches.pop(channel, [])
                texts = _notifications({"t": "events", "events": events})
            else:
                texts = [text]
            for each in texts:
                while True:  # sent again, on a new connection, while PostgreSQL drops it
                    try:
                        conn = conn or self._connect(SENDER)
                        conn.execute("SELECT pg_notify(%s, %s)", (channel, each))
                        waits = _backoff()
                        break
                    except psycopg.Error as err:
                        if conn is not None:
                            conn.close()
                        conn = None
                        log.warning("relay broker: sending failed (%s); connecting again", _one_line(err))
                        if self._stop.wait(next(waits)):
                            break  # stopping: not sent
        if conn is not None:
            conn.close()

    def _listen(self, conn: psycopg.Connection | None) -> None:
        waits = _backoff()
        while not self._stop.is_set():
            try:
                conn = conn or self._listening()
                with conn:
                    waits = _backoff()
                    while not self._stop.is_set():
                        for note in conn.notifies(timeout=0.5):
                            self._handle(note.payload)
                            if self._stop.is_set():
                                break
            except psycopg.Error as err:
                conn = None
                log.warning("relay broker: listening failed (%s); connecting again", _one_line(err))
                self._stop.wait(next(waits))

    def _connect(self, name: str) -> psycopg.Connection:
        return psycopg.connect(self._dsn, autocommit=True, application_name=name)

    def _listening(self) -> psycopg.Connection:
        conn = self._connect(LISTENER)
        conn.execute(f"LISTEN {HOLDERS}")
        conn.execute(f"LISTEN {self.channel}")
        return conn

    def _handle(self, payload: str) -> None:
        """Take one notification; a message that cannot be taken is logged, and the listener goes on."""
        try:
            self._take(json.loads(payload))
        except Exception:
            log.exception("relay broker: a message could not be taken: %.200s", payload)

    def _take(self, message: dict) -> None:
        kind = message["t"]
        if kind == "stop":
            return
        if kind == "part":
            parts = self._parts.setdefault(message["m"], [])
            parts.append(message["d"])
            if len(parts) == message["n"]:
                del self._parts[message["m"]]
                self._take(json.loads("".join(parts)))
        elif kind == "holds":
            if message["at"] != self.channel:
                with self._lock:
                    self._holders[message["lease"]] = (message["at"], time.monotonic())
        elif kind == "submit":
            self._serve(message)
        elif kind == "events":
            for event in (RelayEvent.model_validate(e) for e in message["events"]):
                with self._lock:
                    generation = self._waiting.get(event.id)
                    if event.kind in ("done", "error"):
                        self._waiting.pop(event.id, None)
                if generation is not None:
                    generation.put(event)
        elif kind == "lost":  # the replica serving it was lost where it was: it goes on elsewhere
            with self._lock:
                generation = self._waiting.pop(message["id"], None)
            if generation is not None:
                generation.lost.add(message["lease"])
                generation.put(("lost", message["id"]))
        elif kind == "cancel":
            with self._lock:
                generation = self._serving.pop(message["id"], None)
            if generation is not None:
                generation.cancel()

    def _serve(self, message: dict) -> None:
        """Place another process's request on the replica held here, its events sent back."""
        request = RelayRequest.model_validate(message["request"])
        temperature, top_p, max_tokens, stop, seed = message["params"]
        params = SamplingParams(temperature, top_p, max_tokens, tuple(stop), seed)
        reply = message["reply"]

        def forward(event: RelayEvent | tuple[str, str]) -> None:
            ended = isinstance(event, tuple) or event.kind in ("done", "error")
            if ended:
                with self._lock:
                    self._serving.pop(request.id, None)
            if isinstance(event, tuple):  # the replica was lost here: the sender moves the request on
                lost = {"t": "lost", "id": request.id, "lease": generation.lease_id}
                self._post(reply, lost)  # after the events queued before it
            else:
                self._post_event(reply, event)

        generation = RemoteGeneration(
            self.relay, message["deployment"], request, params, message["leases"], time.monotonic()
        )
        generation.put = forward  # type: ignore[method-assign]
        with self._lock:
            self._serving[request.id] = generation
        try:
            self.relay._place(generation, brokered=False)  # held here, or it fails: never sent on
        except ServiceError as err:
            forward(RelayEvent(id=request.id, kind="error", status=503, message=err.message))


def _one_line(err: Exception) -> str:
    return " ".join(str(err).split())


def _backoff() -> Iterator[float]:
    """The waits before each new connection: from ``RECONNECT_S[0]``, doubling up to ``RECONNECT_S[1]``."""
    wait = RECONNECT_S[0]
    while True:
        yield wait
        wait = min(2 * wait, RECONNECT_S[1])


def _notifications(message: dict) -> list[str]:
    """The message as notification payloads: itself, or its parts."""
    text = json.dumps(message)
    if len(text) <= PART:
        return [text]
    key = secrets.token_hex(6)
    chunks = [text[i : i + PART] for i in range(0, len(text), PART)]
    return [
        json.dumps({"t": "part", "m": key, "i": i, "n": len(chunks), "d": c}) for i, c in enumerate(chunks)
    ]


def for_database(url: str, relay: Relay) -> Broker | None:
    """A broker for the coordinator on the database at SQLAlchemy ``url``: PostgreSQL's; None on SQLite
    (one process)."""
    from sqlalchemy import make_url

    parsed = make_url(url)
    if parsed.get_backend_name() != "postgresql":
        return None
    return Broker(parsed.set(drivername="postgresql").render_as_string(hide_password=False), relay)
