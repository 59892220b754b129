"""Inside the task subprocess: read the task config, reach the coordinator with the task token, train.

    python -m gpuflex.agent.runner task.json      # started by the agent's sandbox, never by hand

This is a process entry point, so it reads its environment (set by the agent) here and only here.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from pathlib import Path


def main(argv: list[str]) -> int:
    # inner steps run in torch's deterministic mode, which refuses cuBLAS without a fixed workspace
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    import torch

    from gpuflex.client import TaskClient
    from gpuflex.data.cache import ShardCache
    from gpuflex.data.fetch import FetchedShards, LocalShards
    from gpuflex.protocol.messages import TaskConfig
    from gpuflex.train.task import run_task

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    if threads := int(os.environ.get("GPUFLEX_TASK_THREADS", "0")):
        torch.set_num_threads(threads)
    stop = {"requested": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(requested=True))
    agent = os.getppid()  # if the agent dies (kill -9), nobody supervises or renews us: stop too
    config = TaskConfig.model_validate_json(Path(argv[0]).read_text())
    client = TaskClient(
        os.environ["GPUFLEX_COORDINATOR_URL"],
        os.environ["GPUFLEX_TASK_TOKEN"],
        ca=os.environ.get("GPUFLEX_CA"),
    )
    min_step_s = float(os.environ.get("GPUFLEX_TASK_MIN_STEP_S", "0"))
    cache = None  # the agent's shard cache, shared by its tasks: shards and model files go there
    if cache_dir := os.environ.get("GPUFLEX_SHARD_CACHE"):
        cache = ShardCache(Path(cache_dir), int(os.environ["GPUFLEX_SHARD_CACHE_BYTES"]))
    # a federated worker reads its owner's private dataset where it lies (confined to it, read-only)
    private = os.environ.get("GPUFLEX_PRIVATE_DATA")
    reader = LocalShards(Path(private), cache) if private else FetchedShards(client.get_blob, cache)
    try:
        summary = run_task(
            config,
            client,
            should_stop=lambda: stop["requested"] or os.getppid() != agent,
            after_step=(lambda took: time.sleep(max(0.0, min_step_s - took))) if min_step_s > 0 else None,
            reader=reader,
        )
    finally:
        client.close()
    logging.info("task done: %s", summary)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
