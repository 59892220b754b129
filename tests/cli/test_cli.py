"""The CLI: help everywhere, and an error is one clear line with a non-zero exit, never a traceback."""

import json
import subprocess
import sys

import pytest
from typer.main import get_command
from typer.testing import CliRunner

from gpuflex.cli.main import app
from gpuflex.localnet import free_port


def _commands(group, prefix=()):
    for name, command in getattr(group, "commands", {}).items():
        yield (*prefix, name)
        yield from _commands(command, (*prefix, name))


ALL_COMMANDS = list(_commands(get_command(app)))


def test_every_documented_command_exists():
    expected = {
        ("demo",),
        ("coordinator", "serve"),
        ("coordinator", "migrate"),
        ("provider", "start"),
        ("account", "create"),
        ("account", "use"),
        ("account", "profiles"),
        ("whoami",),
        ("wallet", "deposit"),
        ("wallet", "balance"),
        ("submit",),
        ("quote",),
        ("jobs",),
        ("job", "show"),
        ("job", "logs"),
        ("job", "cancel"),
        ("job", "fetch"),
        ("offers",),
        ("ledger", "verify"),
        ("job", "report"),
        ("job", "watch"),
        ("provider", "dashboard"),
        ("train", "local"),
        ("data", "prepare"),
        ("governance", "propose"),
        ("governance", "vote"),
        ("governance", "proposals"),
        ("governance", "parameters"),
        ("provider", "wallet"),
        ("provider", "stake"),
        ("provider", "unstake"),
        ("provider", "withdraw"),
        ("operator", "slash"),
        ("slashes",),
        ("serve",),
    }
    assert expected <= set(ALL_COMMANDS)


@pytest.mark.parametrize("command", ALL_COMMANDS, ids=" ".join)
def test_every_command_has_help(command):
    result = CliRunner().invoke(app, [*command, "--help"])
    assert result.exit_code == 0, result.output
    assert "Usage" in result.output


def _gpuflex(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "gpuflex", *args], capture_output=True, text=True, env=env, timeout=60
    )


@pytest.mark.parametrize("command", ["submit", "quote"])
def test_a_bad_spec_is_one_line_naming_the_field(tmp_path, command):
    spec = tmp_path / "job.yaml"
    spec.write_text("name: x\ntraining: {rounds: 0}\n")
    result = _gpuflex(command, str(spec), "--token", "gfx_x", "--url", "http://127.0.0.1:9")
    assert result.returncode == 1
    assert result.stderr.strip().startswith("error: invalid job spec: training.rounds")
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "command", [["deploy", "--model", ".", "--token", "gfx_x", "--url", "http://127.0.0.1:9"], ["serve", "."]]
)
def test_a_bad_dtype_is_one_line_naming_the_choices(command):
    result = _gpuflex(*command, "--dtype", "fp64")
    assert result.returncode == 1
    assert result.stderr.strip() == "error: --dtype fp64: give one of auto, bf16, fp16, fp32"


@pytest.mark.parametrize(
    ("command", "says"),
    [
        (
            ["deploy", "--model", "{dir}", "--token", "gfx_x", "--url", "http://127.0.0.1:9"],
            "--model {dir}: ",
        ),
        (["serve", "{dir}"], "{dir}: "),
    ],
)
def test_a_missing_model_directory_is_named_by_its_option(tmp_path, command, says):
    typo = str(tmp_path / "typo")
    result = CliRunner().invoke(app, [a.format(dir=typo) for a in command])
    assert result.exit_code == 1
    assert result.exception.message == says.format(dir=typo) + "no such directory"


@pytest.mark.parametrize(
    "command",
    [["deploy", "--model", "{dir}", "--token", "gfx_x", "--url", "http://127.0.0.1:9"], ["serve", "{dir}"]],
)
def test_a_directory_that_is_no_model_says_what_to_give(tmp_path, command):
    empty = tmp_path / "notes"
    empty.mkdir()
    result = CliRunner().invoke(app, [a.format(dir=empty) for a in command])
    assert result.exit_code == 1
    assert result.exception.message.startswith(f"{empty} holds no config.json: give a save_pretrained")


def test_an_unreachable_coordinator_is_one_line(tmp_path):
    result = _gpuflex("jobs", "--token", "gfx_x", "--url", "http://127.0.0.1:9")
    assert result.returncode == 1
    assert "cannot reach the coordinator" in result.stderr and "Traceback" not in result.stderr


def test_a_missing_token_says_how_to_get_one(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    result = _gpuflex("jobs", "--url", "http://127.0.0.1:9", env=env)
    assert result.returncode == 1 and "gpuflex account create" in result.stderr


def test_ledger_verify_checks_signatures_and_the_pinned_key(tmp_path):
    import dataclasses
    import json

    from gpuflex.auth.signing import NodeKey
    from gpuflex.ledger.export import to_export
    from gpuflex.ledger.journal import make_entry, signed_message

    key, other = NodeKey.generate(), NodeKey.generate()
    deposit = {"at": "2026-01-01T00:00:00+00:00", "kind": "deposit", "memo": "d"}
    first = make_entry(None, **deposit, postings=(("world", -5), ("consumer:a", 5)))
    first = dataclasses.replace(first, signature=key.private_key.sign(signed_message(first.hash)).hex())
    export = to_export([first], public_key=key.public_key_hex).model_dump()

    def verify(name: str, *args: str) -> subprocess.CompletedProcess:
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(export))
        return _gpuflex("ledger", "verify", "--from", str(path), *args)

    ok = verify("good")
    assert ok.returncode == 0 and "1 entries, chain verified" in ok.stdout
    assert f"signed by key {key.public_key_hex}" in ok.stdout
    assert verify("good", "--public-key", key.public_key_hex).returncode == 0
    pinned = verify("good", "--public-key", other.public_key_hex)
    assert pinned.returncode == 1 and len(pinned.stderr.strip().splitlines()) == 1
    assert f"not by the key you trust ({other.public_key_hex})" in pinned.stderr

    export["entries"][0]["postings"][1]["amount"] = 6
    export["entries"][0]["postings"][0]["amount"] = -6
    broken = verify("bad")
    assert broken.returncode == 1 and "BROKEN" in broken.stderr and "seq 1" in broken.stderr

    # Re-hashed consistently, as an attacker would: only the signature gives it away.
    export["entries"][0]["hash"] = make_entry(
        None, **deposit, postings=(("world", -6), ("consumer:a", 6))
    ).hash
    rehashed = verify("rehashed")
    assert rehashed.returncode == 1 and "seq 1: signature does not verify" in rehashed.stderr


def test_the_demo_never_wipes_a_directory_it_did_not_make(tmp_path):
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "thesis.tex").write_text("years of work")
    result = _gpuflex("demo", "--data-dir", str(precious))
    assert result.returncode == 1 and "was not made by `gpuflex demo`" in result.stderr
    assert (precious / "thesis.tex").read_text() == "years of work"


@pytest.mark.parametrize(
    ("variable", "value", "says"),
    [
        ("GPUFLEX_HEARTBEAT_INTERVAL_S", "abc", "GPUFLEX_HEARTBEAT_INTERVAL_S: Input should be a valid"),
        ("GPUFLEX_BLOB_STORAGE_OPTIONS", "not json", 'field "blob_storage_options"'),
    ],
)
def test_a_bad_coordinator_setting_is_one_line_naming_it(tmp_path, variable, value, says):
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), variable: value}
    result = _gpuflex("coordinator", "serve", "--data-dir", str(tmp_path), "--port", "9", env=env)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.startswith("error: bad setting: ") and says in result.stderr


def test_a_blob_store_that_cannot_be_reached_stops_the_coordinator_at_start_in_one_line(tmp_path):
    pytest.importorskip("s3fs", reason="s3fs is not installed (pip install -e '.[s3]')")
    nowhere = {"endpoint_url": f"http://127.0.0.1:{free_port()}", "key": "k", "secret": "s"}
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(tmp_path),
        "GPUFLEX_BLOB_URL": "s3://gpuflex/blobs",
        "GPUFLEX_BLOB_STORAGE_OPTIONS": json.dumps(nowhere),
    }
    result = _gpuflex("coordinator", "serve", "--data-dir", str(tmp_path), "--port", "9", env=env)
    assert result.returncode == 1 and "Traceback" not in result.stderr and "serving on" not in result.stdout
    said = result.stderr.strip().splitlines()[-1]  # after the migrations' log lines
    assert said.startswith("error: the blob store s3://gpuflex/blobs cannot be written: Could not connect")


def _bracketed_helps():
    for command in ALL_COMMANDS:
        group = get_command(app)
        for name in command:
            group = group.commands[name]
        for param in group.params:
            text = (getattr(param, "help", None) or "").replace("\\[", "[")
            if "[" in text:
                yield command, text[text.index("[") :]


@pytest.mark.parametrize(("command", "bracketed"), list(_bracketed_helps()), ids=lambda v: str(v)[:40])
def test_option_help_keeps_its_brackets(command, bracketed):
    """Rich reads "[env X]" as markup and drops it from --help unless it is escaped."""
    result = CliRunner().invoke(app, [*command, "--help"], env={"COLUMNS": "400"}, terminal_width=400)
    assert bracketed in " ".join(result.output.split()), result.output
