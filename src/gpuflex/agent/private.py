"""An owner's private datasets: checked when its agent starts, announced by name and size only.

``gpuflex provider start --private-data NAME=DIR`` offers DIR, a ``gpuflex data prepare`` output, to
federated jobs that ask for NAME. What the coordinator learns of it is a ``PrivateDataset``: the name, its
train tokens (the owner's FedAvg weight), its shard count and its manifest's hash; the manifest itself
(which names the source files) and the shards stay here. A federated worker task of this node reads DIR
read-only inside its sandbox (``daemon``), and checks the manifest's hash against the announced one.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

from gpuflex.data.manifest import read_manifest
from gpuflex.errors import BadRequest
from gpuflex.protocol.messages import PrivateDataset
from gpuflex.protocol.spec import DATASET_NAME


def parse_private_data(pairs: list[str]) -> dict[str, Path]:
    """``NAME=DIR`` options as {name: absolute dir}; BadRequest naming the bad one."""
    found: dict[str, Path] = {}
    for pair in pairs:
        name, sep, directory = pair.partition("=")
        if not sep or not directory or not re.match(DATASET_NAME, name):
            raise BadRequest(
                f"--private-data {pair!r}: give NAME=DIR, NAME letters, digits, '.', '_' or '-' (up to 64)"
            )
        if name in found:
            raise BadRequest(f"--private-data names {name!r} twice")
        found[name] = Path(directory).expanduser().resolve()
    return found


def announce(datasets: Mapping[str, Path]) -> list[PrivateDataset]:
    """What the node announces of each dataset; BadRequest (one line) for a directory that is not a
    prepared dataset."""
    out = []
    for name, directory in datasets.items():
        if not directory.is_dir():
            raise BadRequest(f"--private-data {name}={directory}: no such directory")
        try:
            manifest = read_manifest(directory)
        except BadRequest as err:
            raise BadRequest(f"--private-data {name}={directory}: {err.message}") from None
        out.append(
            PrivateDataset(
                name=name,
                tokens=manifest.train_tokens,
                shards=len(manifest.train) + len(manifest.validation),
                manifest=manifest.digest,
            )
        )
    return out
