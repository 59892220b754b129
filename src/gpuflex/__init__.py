"""GPUFlex: a hybrid GPU cloud that trains models on many unreliable nodes.

Map of the packages (data flows down this list, never up; import-linter checks it):

- ``cli``, ``demo``     entry points: the Typer CLI and the one-command local network
- ``coordinator``       the HTTP service: routes -> services -> database
- ``agent``             the provider daemon: probe, benchmark, register, heartbeat, lease, run
- ``client``            the SDK every process uses to reach the coordinator over HTTP
- ``train``             the DiLoCo runtime that a task runs (pure PyTorch)
- ``market``, ``ledger``, ``storage``, ``auth``   pure logic and the blob store
- ``protocol``          the wire contract: pydantic models for every message and the job spec
- ``errors``            the exception hierarchy
"""

__version__ = "0.1.0"
