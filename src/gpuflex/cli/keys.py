"""``privacy.encrypt`` on the consumer's machine: the consumer's sealing key, the job's data key, and
``gpuflex job keys``, which seals that key to each node while it holds a live lease on the job.

The consumer's X25519 key lives beside the profile file (``~/.gpuflex/sealing.key``, mode 0600), made on
the first encrypted submit; a job's data key is made here, sealed to it and submitted with the job, so
any later ``job keys``, ``job watch`` or ``job fetch`` on a machine holding that key opens it. Before
sealing to a node, its X25519 key is checked against the node's Ed25519 signature (the node's id is the
hash of its Ed25519 key), so the coordinator cannot slip in a key of its own.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from rich.console import Console

from gpuflex.auth import sealing
from gpuflex.auth.signing import check_sealing_key
from gpuflex.cli.options import Token, Url
from gpuflex.cli.profile import consumer_client, profile_path
from gpuflex.client import Client
from gpuflex.errors import BadRequest, Conflict, GPUFlexError, RateLimited, ServiceError, Unauthorized
from gpuflex.privacy.envelope import (
    JOB_BLOB,
    decrypt_blob,
    encrypt_blob,
    keyed_digest,
    new_data_key,
    public_bytes,
    seal_for_consumer,
    seal_key,
    unseal_for_consumer,
)
from gpuflex.protocol import messages as m

console = Console()
POLL_S = 1.0


def key_path() -> Path:
    return profile_path().parent / "sealing.key"


def consumer_key() -> X25519PrivateKey:
    """This machine's consumer sealing key, which opens the jobs submitted from here."""
    path = key_path()
    if not path.exists():
        raise BadRequest(
            f"no sealing key at {path}: an encrypted job's key opens only with the sealing key of the "
            "machine that submitted it (copy that file here)"
        )
    return sealing.load(path)


@dataclass(frozen=True)
class JobKey:
    """A new job's data key on the consumer's machine, and that key sealed to this machine's key (what the
    job is submitted with)."""

    key: bytes
    sealed: str

    def seal(self, data: bytes) -> bytes:
        """``data`` encrypted under the job's key, to upload."""
        return encrypt_blob(self.key, data, JOB_BLOB)

    def digest(self, data: bytes) -> str:
        """``data``'s hash keyed by the job's key: what only this key's holders can check it against."""
        return keyed_digest(self.key, data)


def new_job_key() -> JobKey:
    """A new job's data key, sealed to this machine's key (made on the first encrypted submit)."""
    key = new_data_key()
    return JobKey(key, seal_for_consumer(key, public_bytes(sealing.load_or_create(key_path()))).hex())


def data_key(keys: m.JobKeys, key: X25519PrivateKey) -> bytes:
    """The job's data key, opened with the consumer's key; one clear line if it does not open."""
    try:
        return unseal_for_consumer(bytes.fromhex(keys.sealed_key), key)
    except BadRequest as err:
        raise BadRequest(
            f"job {keys.job_id}'s data key does not open with {key_path()} ({err.message}): it opens only "
            "with the sealing key of the machine that submitted the job"
        ) from None


def job_data_key(client: Client, job_id: str) -> bytes:
    """An encrypted job's data key, opened on this machine."""
    return data_key(client.job_keys(job_id), consumer_key())


def open_checkpoint(key: bytes, checkpoint: bytes) -> bytes:
    """An encrypted job's checkpoint, opened with its data key (``job_data_key``)."""
    return decrypt_blob(key, checkpoint, JOB_BLOB)


def seal_requests(client: Client, job_id: str, key: X25519PrivateKey, say: Callable[[str], None]) -> bool:
    """Seal the job's data key to every node now holding a live lease without one (each node's sealing key
    checked against its signature first); returns whether the job still runs."""
    keys = client.job_keys(job_id)
    if not keys.requests:
        return keys.open
    opened = data_key(keys, key)
    for r in keys.requests:
        who = f"{r.task} on {r.node_name} ({r.node_id})"
        if r.sealing_key is None or r.sealing_key_signature is None:
            say(f"not sealed to {who}: the node registered no sealing key (an older agent)")
            continue
        try:
            check_sealing_key(r.node_id, r.public_key, r.sealing_key, r.sealing_key_signature)
        except Unauthorized as err:
            say(f"not sealed to {who}: {err.message}")
            continue
        sealed = seal_key(opened, bytes.fromhex(r.sealing_key), keys.job_id).hex()
        try:
            client.grant_key(job_id, m.KeyGrant(lease_id=r.lease_id, epoch=r.epoch, sealed_key=sealed))
        except Conflict:
            continue  # the lease ended meanwhile: its node gets nothing; a new lease asks again
        say(f"data key sealed to {who}, lease {r.lease_id} epoch {r.epoch}")
    return keys.open


def serve_keys(client: Client, job_id: str, stop: threading.Event, say: Callable[[str], None]) -> None:
    """Seal the job's key to each newly leased node until the job ends or ``stop`` is set. The coordinator
    out of reach (or rate limiting) is said and retried, the job's nodes waiting meanwhile; any other
    refusal (no such job, a key that does not open) ends it with its one line."""
    key, said = consumer_key(), set()

    def once(line: str) -> None:  # a node that cannot be sealed to asks again every poll: say it once
        if line not in said:
            said.add(line)
            say(line)

    while not stop.is_set():
        try:
            if not seal_requests(client, job_id, key, once):
                return
        except (ServiceError, RateLimited) as err:
            say(f"keys: {err.message}; retrying")  # each time: the nodes wait while it lasts
        stop.wait(POLL_S)


def in_background(client: Client, job_id: str, say: Callable[[str], None]) -> Callable[[], None]:
    """Serve the job's keys beside a watch, saying what it does with ``say``; returns what stops it."""
    stop = threading.Event()

    def serve() -> None:
        try:
            serve_keys(client, job_id, stop, say)
        except GPUFlexError as err:  # said beside the watch, which goes on
            say(f"keys: {err.message}")

    thread = threading.Thread(target=serve, name="keys", daemon=True)
    thread.start()

    def stopped() -> None:
        stop.set()
        thread.join(timeout=5)

    return stopped


def _say(line: str) -> None:
    console.print(line, highlight=False)


def keys(
    job_id: Annotated[str, typer.Argument(help="job id as `gpuflex jobs` lists it, or any unique prefix")],
    url: Url = None,
    token: Token = None,
) -> None:
    """Serve an encrypted job's data key (privacy.encrypt): seal it to each node while it holds a live
    lease on the job, until the job ends. While nothing serves it (this, `submit --watch` or `job watch`),
    newly leased nodes wait, paid (up to `privacy.key_wait_s`), and the job's log says so."""
    client = consumer_client(url, token)
    _say(f"serving job {job_id}'s data key to its leased nodes until it ends (Ctrl-C stops)")
    try:
        serve_keys(client, job_id, threading.Event(), _say)
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    _say(f"job {job_id} has ended: no more keys to serve")
