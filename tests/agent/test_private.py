"""An owner's private datasets: checked at the agent's start, announced by name, size and hash only."""

import pytest

from gpuflex.agent.private import announce, parse_private_data
from gpuflex.data.manifest import read_manifest
from gpuflex.errors import BadRequest
from gpuflex.testing import prepare_bytes, write_corpus


def test_a_prepared_dataset_is_announced_by_its_name_tokens_shards_and_manifest_hash(tmp_path):
    write_corpus(tmp_path / "text")
    prepared = prepare_bytes(tmp_path / "text", tmp_path / "prepared", shard_tokens=9_000, val_tokens=4_000)
    manifest = read_manifest(prepared)
    datasets = parse_private_data([f"notes={prepared}"])
    assert datasets == {"notes": prepared.resolve()}
    (announced,) = announce(datasets)
    assert announced.model_dump() == {
        "name": "notes",
        "tokens": manifest.train_tokens,
        "shards": len(manifest.train) + len(manifest.validation),
        "manifest": manifest.digest,
    }


@pytest.mark.parametrize(
    ("pairs", "says"),
    [
        (["notes"], "give NAME=DIR"),
        (["bad name=/x"], "give NAME=DIR"),
        (["notes=/a", "notes=/b"], "names 'notes' twice"),
    ],
)
def test_bad_private_data_options_are_one_line(pairs, says):
    with pytest.raises(BadRequest, match=says):
        parse_private_data(pairs)


def test_a_directory_that_is_not_a_prepared_dataset_stops_the_agent_with_one_line(tmp_path):
    (tmp_path / "raw").mkdir()
    with pytest.raises(
        BadRequest, match=r"--private-data notes=.*/raw: .* has no manifest.json: not a prepared"
    ):
        announce({"notes": tmp_path / "raw"})
    with pytest.raises(BadRequest, match=r"--private-data notes=.*/absent: no such directory"):
        announce({"notes": tmp_path / "absent"})
