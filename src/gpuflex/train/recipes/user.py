"""A user recipe: a Python file of the consumer's that exposes three functions.

    def build_model(spec) -> torch.nn.Module
    def build_data(dataset: bytes | None, spec, worker_index: int, num_workers: int) -> TaskData
    def loss(model, batch) -> torch.Tensor

It travels with the job as a blob and runs inside the provider's task sandbox, like all task code.
``examples/recipes/byte_bigram.py`` is a complete one.
"""

from __future__ import annotations

import types

from gpuflex.errors import BadRequest
from gpuflex.train.recipes import Recipe

REQUIRED = ("build_model", "build_data", "loss")


def load_user_recipe(code: bytes) -> Recipe:
    module = types.ModuleType("gpuflex_user_recipe")
    try:
        exec(compile(code, "<user recipe>", "exec"), module.__dict__)  # task code, run in the task sandbox
    except Exception as err:
        raise BadRequest(f"the user recipe failed to load: {type(err).__name__}: {err}") from None
    missing = [name for name in REQUIRED if not callable(getattr(module, name, None))]
    if missing:
        raise BadRequest(f"the user recipe must define {', '.join(missing)}")
    return Recipe(
        name="user",
        build_model=module.build_model,
        build_data=module.build_data,
        loss=module.loss,
        needs_dataset=getattr(module, "NEEDS_DATASET", True),
    )
