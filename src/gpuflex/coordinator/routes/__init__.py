"""Thin routers: parse the request, call one service inside one transaction, return a protocol model.

``errors(...)`` documents the error answers a route gives, so the OpenAPI schema lists every status a
client can meet (``tests/coordinator/test_fuzz.py`` holds the app to it). A rule the schema states is
one a client can check before it sends; ``unstated(...)`` documents a refusal of a request the schema
accepts, for a rule it cannot state.
"""

from gpuflex.protocol.messages import ErrorBody

_WHY = {
    400: "malformed or invalid input",
    401: "missing or bad credentials or signature",
    402: "the wallet does not cover it",
    403: "authenticated, but not allowed",
    404: "no such id (or not yours)",
    409: "the current state does not allow it, or an id prefix fits several ids (the detail lists them)",
    413: "the body is over the size limit",
    416: "the Range starts past the blob's end",
    422: "a field is missing or invalid (the detail names it)",
    429: "too many requests: retry after Retry-After seconds",
    503: "the database is busy: retry after Retry-After seconds",
}


def errors(*codes: int) -> dict[int | str, dict]:
    """OpenAPI ``responses`` for these error statuses, each an ``ErrorBody``."""
    return {code: {"model": ErrorBody, "description": _WHY[code]} for code in codes}


# The OpenAPI extension that marks a response as the refusal of a request the schema accepts.
UNSTATED_RULE = "x-unstated-rule"


def unstated(code: int, rule: str) -> dict[int | str, dict]:
    """OpenAPI ``responses`` for a refusal that no schema can state: it depends on more than the request's
    shape (a body whose hash is not its key, a blob the store lacks, the job's state) or relates fields
    beyond what JSON Schema says (one at most another)."""
    return {code: {"model": ErrorBody, "description": rule, UNSTATED_RULE: True}}


# A job spec's rules across its fields (``protocol.spec``), and privacy.dp's accountant's.
SPEC_RULES = unstated(
    422,
    "a rule across the spec's fields (min_workers at most workers, batch_size a multiple of "
    "micro_batch_size, a recipe for the data, ...) or a privacy.dp budget the accountant refuses: the detail "
    "names it",
)


# A public read (``auth.Public``) needs no credentials: only credentials sent and found bad are a 401.
PUBLIC_READ = {
    401: {"model": ErrorBody, "description": "credentials were sent and are bad (none are needed)"}
}


# What any /v1 call may answer: bad bodies, credentials, size and rate limits, a busy database.
COMMON_ERRORS = errors(400, 401, 403, 413, 422, 429, 503)
