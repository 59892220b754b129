"""Bearer tokens: consumers' API tokens, the lease-scoped tokens of task subprocesses, the operator's, and
API keys scoped to one deployment (what OpenAI clients send to the gateway).

The coordinator stores only a token's sha256, so a leaked database does not leak tokens.
"""

import hashlib
import secrets

API_PREFIX = "gfx_"
TASK_PREFIX = "gfxtask_"
OPERATOR_PREFIX = "gfxop_"
DEPLOYMENT_KEY_PREFIX = "gfxkey_"


def new_api_token() -> str:
    return API_PREFIX + secrets.token_urlsafe(32)


def new_task_token() -> str:
    return TASK_PREFIX + secrets.token_urlsafe(32)


def new_deployment_key() -> str:
    return DEPLOYMENT_KEY_PREFIX + secrets.token_urlsafe(32)


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()
