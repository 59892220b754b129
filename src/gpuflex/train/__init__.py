"""The DiLoCo training runtime a task runs: pure PyTorch, reaching the network only through ``Transport``.

Map of the files (data flows down this list):

- ``task``         the entry point the agent's subprocess calls: dispatches on the task's role
- ``worker``       a DiLoCo worker: H inner AdamW steps on its shard, uploads a compressed pseudo-gradient
- ``aggregator``   waits for a quorum, averages pseudo-gradients by tokens, takes the outer Nesterov step
- ``transport``    the interface to the network, and ``LocalTransport``, its in-memory implementation
- ``compression``  pseudo-gradient codecs (none, fp16, int8) and error feedback
- ``checkpoint``   model state <-> safetensors bytes (never pickle: blobs come from untrusted nodes)
- ``recipes``      recipe name -> a seeded model
- ``model``        CharGPT, a nanoGPT-style byte-level decoder
- ``data``         the byte-level dataset: split, shards, reproducible batches
- ``corpus``       builds the training text (the Python standard library or a directory); no torch

This ``__init__`` imports nothing, so ``import gpuflex.train.corpus`` stays cheap (no torch).
"""
