"""The exception hierarchy. The CLI turns any of these into one clear line; the API into a 4xx.

GPUFlexError
├── BadRequest          malformed or invalid input                 -> 400 / 422
│   ├── SpecError       a job spec that does not validate (names the field)
│   └── HashMismatch    bytes that do not hash to the sha256 they were named by (a shard, a cached blob)
├── Unauthorized        missing or bad credentials or signature    -> 401
├── Forbidden           authenticated, but not yours               -> 403
├── NotFound            unknown id                                 -> 404
├── Conflict            state does not allow it (stale epoch, ...) -> 409
│   └── InsufficientFunds
├── PayloadTooLarge     body or blob over the limit                -> 413
├── RangeNotSatisfiable a byte range that starts past a blob's end  -> 416
├── RateLimited         too many requests; retry after a while     -> 429
└── ServiceError        the coordinator could not be reached or answered 5xx
"""


class GPUFlexError(Exception):
    """Base of every error GPUFlex raises on purpose."""

    status_code = 400

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class BadRequest(GPUFlexError):
    status_code = 400


class SpecError(BadRequest):
    status_code = 422


class HashMismatch(BadRequest):
    """Content addressed by sha256 whose bytes hash to something else: corrupt or substituted."""


class Unauthorized(GPUFlexError):
    status_code = 401


class Forbidden(GPUFlexError):
    status_code = 403


class NotFound(GPUFlexError):
    status_code = 404


class Conflict(GPUFlexError):
    status_code = 409


class InsufficientFunds(Conflict):
    status_code = 402


class PayloadTooLarge(GPUFlexError):
    status_code = 413


class RangeNotSatisfiable(GPUFlexError):
    status_code = 416


class RateLimited(GPUFlexError):
    status_code = 429

    def __init__(self, message: str, retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ServiceError(GPUFlexError):
    status_code = 503


_BY_STATUS = {
    400: BadRequest,
    401: Unauthorized,
    402: InsufficientFunds,
    403: Forbidden,
    404: NotFound,
    409: Conflict,
    413: PayloadTooLarge,
    416: RangeNotSatisfiable,
    429: RateLimited,
    422: SpecError,
}


def from_status(status_code: int, message: str) -> GPUFlexError:
    """The error a client raises for an HTTP error response."""
    return _BY_STATUS.get(status_code, ServiceError)(message)
