"""The CLI: help everywhere, and an error is one clear line with a non-zero exit, never a traceback."""

import subprocess
import sys

import pytest
from typer.main import get_command
from typer.testing import CliRunner

from gpuflex.cli.main import app


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
        ("wallet", "deposit"),
        ("wallet", "balance"),
        ("submit",),
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
        ("governance", "propose"),
        ("governance", "vote"),
        ("governance", "proposals"),
        ("governance", "parameters"),
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


def test_a_bad_spec_is_one_line_naming_the_field(tmp_path):
    spec = tmp_path / "job.yaml"
    spec.write_text("name: x\ntraining: {rounds: 0}\n")
    result = _gpuflex("submit", str(spec), "--token", "gfx_x", "--url", "http://127.0.0.1:9")
    assert result.returncode == 1
    assert result.stderr.strip().startswith("error: invalid job spec: training.rounds")
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_an_unreachable_coordinator_is_one_line(tmp_path):
    result = _gpuflex("jobs", "--token", "gfx_x", "--url", "http://127.0.0.1:9")
    assert result.returncode == 1
    assert "cannot reach the coordinator" in result.stderr and "Traceback" not in result.stderr


def test_a_missing_token_says_how_to_get_one(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    result = _gpuflex("jobs", "--url", "http://127.0.0.1:9", env=env)
    assert result.returncode == 1 and "gpuflex account create" in result.stderr


def test_ledger_verify_reports_a_tampered_export(tmp_path):
    from gpuflex.ledger.export import to_export
    from gpuflex.ledger.journal import make_entry

    first = make_entry(
        None,
        at="2026-01-01T00:00:00+00:00",
        kind="deposit",
        memo="d",
        postings=(("world", -5), ("consumer:a", 5)),
    )
    export = to_export([first]).model_dump()
    good = tmp_path / "good.json"
    good.write_text(__import__("json").dumps(export))
    ok = _gpuflex("ledger", "verify", "--from", str(good))
    assert ok.returncode == 0 and "1 entries, chain verified" in ok.stdout
    export["entries"][0]["postings"][1]["amount"] = 6
    export["entries"][0]["postings"][0]["amount"] = -6
    bad = tmp_path / "bad.json"
    bad.write_text(__import__("json").dumps(export))
    broken = _gpuflex("ledger", "verify", "--from", str(bad))
    assert broken.returncode == 1 and "BROKEN" in broken.stderr and "seq 1" in broken.stderr


def test_the_demo_never_wipes_a_directory_it_did_not_make(tmp_path):
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "thesis.tex").write_text("years of work")
    result = _gpuflex("demo", "--data-dir", str(precious))
    assert result.returncode == 1 and "was not made by `gpuflex demo`" in result.stderr
    assert (precious / "thesis.tex").read_text() == "years of work"
