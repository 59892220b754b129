"""The relay as a deployment's replica sees it (``protocol.relay``), authenticated by its task token."""

from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request
from starlette.concurrency import run_in_threadpool

from gpuflex.auth.tokens import token_hash
from gpuflex.coordinator.auth import Ctx, bearer, charge, task_token
from gpuflex.coordinator.db import Lease, Task
from gpuflex.coordinator.routes import errors
from gpuflex.coordinator.services import deployments, leases
from gpuflex.errors import Forbidden, Unauthorized
from gpuflex.protocol.relay import RelayEvents, RelayPhase, RelayWork

router = APIRouter(prefix="/task/relay", tags=["tasks"], responses=errors(404, 409))

MAX_WAIT_S = 30.0


def server_lease(request: Request, ctx: Ctx) -> Lease:
    """The caller's live lease, if it is a deployment's replica's: one read (a plain ``def``: in the
    thread pool), not ``auth.current_task``'s write transaction, for a poll comes with every request."""
    token = task_token(request)
    with ctx.read() as s:
        lease = leases.authenticate_task(s, token, ctx.now())
        if s.get(Task, lease.task_id).role != "server":
            raise Forbidden("only a deployment's server task is relayed requests")
    charge(request, f"lease:{lease.id}")
    return lease


ServerLease = Annotated[Lease, Depends(server_lease)]


async def serving_lease(lease: ServerLease, ctx: Ctx) -> Lease:
    """The polling replica's lease, live from its first poll on: a replica polls once its model is loaded
    (``deployments.ready``, in the thread pool; later polls write nothing)."""
    if lease.phase != deployments.SERVING:

        def ready() -> None:
            with ctx.tx() as s:
                deployments.ready(s, lease, ctx.now())

        await run_in_threadpool(ready)
    return lease


@router.post("/phase")
def phase(body: RelayPhase, lease: ServerLease, ctx: Ctx) -> dict[str, str]:
    """What the replica does before its first poll (downloading, loading the model): its deployment's
    view says it, and its log when it began."""
    with ctx.tx() as s:
        deployments.report_phase(s, lease, body.phase, ctx.now())
    return {"status": "recorded"}


@router.get("")
async def poll(
    request: Request,
    lease: Annotated[Lease, Depends(serving_lease)],
    wait: Annotated[float, Query(ge=0, le=MAX_WAIT_S)] = 20.0,
) -> RelayWork:
    """The requests to serve and to cancel, as soon as there are some or after ``wait`` seconds; the first
    makes the replica live. A poll whose connection drops loses the replica: its requests move to another
    replica at once."""
    token = bearer(request)
    assert token is not None, "the lease was authenticated by its token"
    return await request.app.state.relay.poll(lease.id, token_hash(token), wait, _dropped(request))


async def _dropped(request: Request) -> None:
    """Ends when the poll's connection drops (the replica killed, or its machine gone)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def polling_replica(request: Request) -> str:
    """The lease of the replica posting events: one polling this process, whose token its polls checked
    against the database (so a post reads nothing there; a lease that ended fails its next poll)."""
    token = bearer(request)
    lease_id = request.app.state.relay.lease_of(token_hash(token)) if token else None
    if lease_id is None:
        raise Unauthorized("this task token is not a replica polling this coordinator: poll first")
    charge(request, f"lease:{lease_id}")
    return lease_id


@router.post("/events")
async def events(
    body: RelayEvents, request: Request, lease_id: Annotated[str, Depends(polling_replica)]
) -> dict[str, str]:
    """What the replica's engine produced for the requests it serves (others' are dropped)."""
    request.app.state.relay.deliver(lease_id, body.events)
    return {"status": "delivered"}
