"""Inside the task subprocess: read the task config, reach the coordinator with the task token, train (or,
for a deployment's ``server`` task, serve: ``agent.server``).

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
    from pydantic import TypeAdapter

    from gpuflex import jsonlog
    from gpuflex.agent.server import run_server
    from gpuflex.client import TaskClient
    from gpuflex.data.cache import ShardCache
    from gpuflex.data.fetch import FetchedShards, LocalShards
    from gpuflex.protocol.messages import AnyTaskConfig, ServerConfig
    from gpuflex.train.task import run_task
    from gpuflex.train.transport import SealedTransport

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    for name in jsonlog.QUIET:  # a line per call: a replica makes one per batch of tokens
        logging.getLogger(name).setLevel(logging.WARNING)
    if threads := int(os.environ.get("GPUFLEX_TASK_THREADS", "0")):
        torch.set_num_threads(threads)
    stop = {"requested": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(requested=True))
    agent = os.getppid()  # if the agent dies (kill -9), nobody supervises or renews us: stop too
    config = TypeAdapter(AnyTaskConfig).validate_json(Path(argv[0]).read_text())
    url, token, ca = (
        os.environ["GPUFLEX_COORDINATOR_URL"],
        os.environ["GPUFLEX_TASK_TOKEN"],
        os.environ.get("GPUFLEX_CA"),
    )
    client = TaskClient(url, token, ca=ca)
    min_step_s = float(os.environ.get("GPUFLEX_TASK_MIN_STEP_S", "0"))
    cache = None  # the agent's shard cache, shared by its tasks: shards and model files go there
    if cache_dir := os.environ.get("GPUFLEX_SHARD_CACHE"):
        cache = ShardCache(Path(cache_dir), int(os.environ["GPUFLEX_SHARD_CACHE_BYTES"]))

    # a federated worker reads its owner's private dataset where it lies (confined to it, read-only)
    private = os.environ.get("GPUFLEX_PRIVATE_DATA")

    def should_stop() -> bool:
        return stop["requested"] or os.getppid() != agent

    try:
        if isinstance(config, ServerConfig):  # a deployment's replica: it serves, it does not train
            sender = TaskClient(url, token, ca=ca)
            try:
                summary = run_server(config, client, sender, cache, should_stop)
            finally:
                sender.close()
        else:
            transport, unseal = client, None
            if config.encrypted:  # the agent writes the job's data key here once the consumer sealed it
                transport = SealedTransport(client, _data_key(Path(argv[0]).parent / DATA_KEY, should_stop))
                unseal = transport.unseal
            summary = run_task(
                config,
                transport,
                should_stop=should_stop,
                after_step=(lambda took: time.sleep(max(0.0, min_step_s - took))) if min_step_s > 0 else None,
                reader=LocalShards(Path(private), cache)
                if private
                else FetchedShards(client.get_blob, cache, unseal),
            )
    finally:
        client.close()
    logging.info("task done: %s", summary)
    return 0


DATA_KEY = "data.key"  # in the task's directory: an encrypted job's data key, opened by the agent


def _data_key(path: Path, should_stop) -> bytes:
    """Wait for the agent to write the data key (the job's log says why the task waits meanwhile)."""
    logging.info("waiting for the job's data key from its consumer")
    while not path.exists():
        if should_stop():
            raise SystemExit(0)
        time.sleep(0.2)
    return path.read_bytes()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
