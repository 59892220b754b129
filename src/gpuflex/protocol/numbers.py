"""Numbers as JSON Schema says them: an integer is no boolean, and its bounds are in the schema.

What the database keeps in 32-bit columns (rounds, epochs, steps, the journal's sequence numbers) or
64-bit ones (tokens) is bounded so: a larger number is a 422 naming the field, not an overflow there.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BeforeValidator, Field

INT32_MAX, INT64_MAX = 2**31 - 1, 2**63 - 1


def not_a_boolean(value: object) -> object:
    """JSON's true and false are no numbers, as the schema says; pydantic would read them as 1 and 0."""
    if isinstance(value, bool):
        raise ValueError("a number, not a boolean")
    return value


# After a ``Field`` in an ``Annotated``, so that the bounds stay in the JSON schema (see ``count``).
NOT_A_BOOLEAN = BeforeValidator(not_a_boolean)


def count(maximum: int, minimum: int = 0) -> object:
    """An integer from ``minimum`` to ``maximum``, not a boolean. Bounds go here, not in an ``Annotated``
    around it: past the validator, pydantic would check them but leave them out of the JSON schema."""
    return Annotated[int, Field(ge=minimum, le=maximum), NOT_A_BOOLEAN]
