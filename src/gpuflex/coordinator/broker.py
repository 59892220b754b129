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

Not brokered: a replica lost on another process fails the request it held there with a 503 (failover
moves requests between the replicas of one process); served rates are counted where the replica is.
"""

from __future__ import annotations

import json
import queue
import secrets
import threading
import time
from collections.abc import Collection

import psycopg

from gpuflex.coordinator.relay import Relay, RemoteGeneration
from gpuflex.errors import ServiceError
from gpuflex.protocol.relay import RelayEvent, RelayRequest
from gpuflex.serve.sampling import SamplingParams

HOLDERS = "gpuflex_relay_holders"
ANNOUNCE_S = 2.0  # a lease is announced again at most this often (on its polls)
HELD_S = 15.0  # an announcement stands this long (a replica polls at least every 10 s)
PART = 3000  # characters of a message per notification (escaped, under PostgreSQL's 8,000 bytes)


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
        listening = psycopg.connect(self._dsn, autocommit=True)
        listening.execute(f"LISTEN {HOLDERS}")
        listening.execute(f"LISTEN {self.channel}")
        sending = psycopg.connect(self._dsn, autocommit=True)
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
        """A replica of ``lease_id`` polls this process (from the event loop: nothing blocks here)."""
        now = time.monotonic()
        if now - self._announced.get(lease_id, -ANNOUNCE_S) >= ANNOUNCE_S:
            self._announced[lease_id] = now
            self._post(HOLDERS, {"t": "holds", "lease": lease_id, "at": self.channel})

    def holder(self, leases: Collection[str]) -> str | None:
        """One of ``leases`` whose replica another process announced lately."""
        now = time.monotonic()
        with self._lock:
            held = [k for k in leases if k in self._holders and now - self._holders[k][1] < HELD_S]
        return held[0] if held else None

    def submit(self, generation: RemoteGeneration, lease_id: str) -> None:
        """Send the generation's request to the process holding ``lease_id``; its events come back."""
        with self._lock:
            channel = self._holders[lease_id][0]
            self._waiting[generation.request.id] = generation
        p = generation.params
        self._post(
            channel,
            {
                "t": "submit",
                "reply": self.channel,
                "lease": lease_id,
                "deployment": generation.deployment_id,
                "request": generation.request.model_dump(mode="json"),
                "params": [p.temperature, p.top_p, p.max_tokens, list(p.stop), p.seed],
            },
        )

    def cancel(self, lease_id: str, request_id: str) -> None:
        with self._lock:
            self._waiting.pop(request_id, None)
            held = self._holders.get(lease_id)
        if held is not None:
            self._post(held[0], {"t": "cancel", "id": request_id})

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

    def _send(self, conn: psycopg.Connection) -> None:
        with conn:
            while (item := self._outbox.get()) is not None:
                channel, text = item
                if text is not None:
                    conn.execute("SELECT pg_notify(%s, %s)", (channel, text))
                    continue
                with self._lock:
                    events = self._batches.pop(channel, [])
                for each in _notifications({"t": "events", "events": events}):
                    conn.execute("SELECT pg_notify(%s, %s)", (channel, each))

    def _listen(self, conn: psycopg.Connection) -> None:
        with conn:
            while not self._stop.is_set():
                for note in conn.notifies(timeout=0.5):
                    self._take(json.loads(note.payload))
                    if self._stop.is_set():
                        break

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
            if isinstance(event, tuple):  # the replica was lost here
                event = RelayEvent(
                    id=request.id, kind="error", status=503, message="the replica serving it was lost"
                )
            if event.kind in ("done", "error"):
                with self._lock:
                    self._serving.pop(request.id, None)
            self._post_event(reply, event)

        generation = RemoteGeneration(
            self.relay, message["deployment"], request, params, [message["lease"]], time.monotonic()
        )
        generation.put = forward  # type: ignore[method-assign]
        with self._lock:
            self._serving[request.id] = generation
        try:
            self.relay._place(generation)
        except ServiceError as err:
            forward(RelayEvent(id=request.id, kind="error", status=503, message=err.message))


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
