"""The relay as a deployment's replica sees it (``protocol.relay``), authenticated by its task token."""

from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request

from gpuflex.coordinator.auth import Ctx, TaskLease
from gpuflex.coordinator.db import Lease, Task
from gpuflex.coordinator.routes import errors
from gpuflex.errors import Forbidden
from gpuflex.protocol.relay import RelayEvents, RelayWork

router = APIRouter(prefix="/task/relay", tags=["tasks"], responses=errors(404, 409))

MAX_WAIT_S = 30.0


def server_lease(lease: TaskLease, ctx: Ctx) -> Lease:
    """The caller's lease, if it is a deployment's replica's (a plain ``def``: read in the thread pool)."""
    with ctx.read() as s:
        if s.get(Task, lease.task_id).role != "server":
            raise Forbidden("only a deployment's server task is relayed requests")
    return lease


ServerLease = Annotated[Lease, Depends(server_lease)]


@router.get("")
async def poll(
    request: Request, lease: ServerLease, wait: Annotated[float, Query(ge=0, le=MAX_WAIT_S)] = 20.0
) -> RelayWork:
    """The requests to serve and to cancel, as soon as there are some or after ``wait`` seconds."""
    return await request.app.state.relay.poll(lease.id, wait)


@router.post("/events")
async def events(body: RelayEvents, request: Request, lease: ServerLease) -> dict[str, str]:
    """What the replica's engine produced for the requests it serves (others' are dropped)."""
    request.app.state.relay.deliver(lease.id, body.events)
    return {"status": "delivered"}
