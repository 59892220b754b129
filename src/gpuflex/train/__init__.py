"""The DiLoCo training runtime a task runs: pure PyTorch, reaching the network only through ``Transport``.

Map of the files (data flows down this list):

- ``local``        a job's tasks as local processes, without the marketplace (``gpuflex train local``)
- ``task``         the entry point the agent's subprocess calls: dispatches on the task's role
- ``worker``       a DiLoCo worker: inner steps, a compressed pseudo-gradient up, the update down
- ``device_group`` one replica over a node's own devices: its ranks, their rounds; DDP (``DataParallel``)
- ``sharding``     ``Sharded``: that replica's model, gradients and AdamW moments split by FSDP2 (``shard``)
- ``optimizers``   the inner optimizer: AdamW, or Muon for the hidden weight matrices and AdamW for the rest
- ``diloco``       ``DiLoCo``: the same, wrapped around a training loop of your own
- ``aggregator``   waits for a quorum, verifies, averages (robustly), compresses the update, outer step
- ``verifier``     judges a round's contributions: commitment checks, screening, audits of drawn ones
- ``robust``       pure: norm and cosine screens, median-norm + centered clipping, the naive mean
- ``audit``        re-executes one trace segment from a worker's uploaded state
- ``commitment``   the trace a worker commits to while training (deterministic mode), its audit states
- ``adversaries``  cheating workers (lazy, free-rider, poisoners, shirkers, adaptive): tests and demos
- ``secure``       secure aggregation in the round: owners mask their share of the average, it unmasks the sum
- ``drill``        a job as a direct loop over these pieces, for the tests and ``bench/verification.py``
- ``outer``        ``GlobalReplica``: global weights + outer optimizer, held identically by every replica
- ``placement``    where a worker's tensors live and in which dtype: base once or quantized, outer on host
- ``sync``         brings a replica to a round: update by update, or from a checkpoint
- ``transport``    the interface to the network, and ``LocalTransport``, its in-memory implementation
- ``throttle``     a simulated link around a transport: meters the bytes, delays each call
- ``compression/`` pseudo-gradient codecs (fp16/bf16, int8/4/2, chunked top-k) and error feedback
- ``checkpoint``   tensors <-> safetensors bytes (never pickle: blobs come from untrusted nodes)
- ``trainable``    the parameters a job trains, exchanges, commits to and checkpoints (LoRA: the adapters)
- ``precision``    an inner step's numerics: autocast dtype, fp16's loss scale, micro-batches
- ``lm_loss``      the next-token loss a chunk of the head's logits at a time, its gradients in the same pass
- ``pretrained``   a job's model directory: checked and sized at submit, linked from the node cache in a task
- ``export``       a checkpoint as a Hugging Face directory (full, LoRA adapter, or merged)
- ``recipes/``     what a job trains: char-gpt, hf-causal-lm, mlp-digits, or a user's recipe file
- ``model``        CharGPT, a nanoGPT-style byte-level decoder
- ``data``         the byte-level dataset: split, shards, reproducible batches
- ``corpus``       builds the training text (the Python standard library or a directory); no torch

This ``__init__`` imports nothing eagerly, so ``import gpuflex.train.corpus`` stays cheap (no torch);
``gpuflex.train.DiLoCo`` and friends load on first use.
"""

_LAZY = {
    "DiLoCo": "gpuflex.train.diloco",
    "inner_optimizer": "gpuflex.train.optimizers",
    "LocalTransport": "gpuflex.train.transport",
    "Transport": "gpuflex.train.transport",
    "aggregate": "gpuflex.train.aggregator",
    "Recipe": "gpuflex.train.recipes",
    "TaskData": "gpuflex.train.recipes",
}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'gpuflex.train' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_LAZY[name]), name)
