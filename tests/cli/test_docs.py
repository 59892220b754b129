"""What a new user reads before running anything — `--help`, the README, the example job's comments —
says what the code does: the governance rules as the settings set them, the offer query's example
whole, what the example job needs, the compression methods the spec accepts, the commands in the examples'
comments."""

import re
import shlex
import shutil
import subprocess
from importlib.resources import files
from pathlib import Path
from typing import get_args

import pytest
import yaml
from typer.testing import CliRunner

from gpuflex.cli.main import app
from gpuflex.coordinator.settings import CoordinatorSettings
from gpuflex.protocol.spec import CompressionSpec, load_job_spec

ROOT = Path(__file__).parents[2]
README = (ROOT / "README.md").read_text()
EXAMPLE = files("gpuflex.examples") / "char-gpt.yaml"
DEFAULT = {name: field.default for name, field in CoordinatorSettings.model_fields.items()}
GOVERNANCE_RULES = [
    f"{DEFAULT['governance_proposal_stake']:g} credits of stake",
    f"open {DEFAULT['governance_voting_period_s'] / 3600:g} h",
    f"at least {DEFAULT['governance_quorum']:.0%} of all stake",
    "more of it voted yes than no",
    "must fall after voting closes",
]


def _help(*command: str) -> str:
    result = CliRunner().invoke(app, [*command, "--help"], env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    return " ".join(result.output.split())  # one line: the rules as a sentence, however it wrapped


@pytest.mark.parametrize("command", [("governance",), ("governance", "propose")], ids=" ".join)
def test_governance_help_states_the_rules_the_settings_set(command):
    shown = _help(*command)
    for rule in GOVERNANCE_RULES:
        assert rule in shown, rule


def test_the_readme_states_the_governance_rules():
    readme = " ".join(README.split())
    for rule in GOVERNANCE_RULES:
        assert rule in readme, rule


def test_the_readme_states_the_minimum_stakes_default_and_where_an_operator_sets_it(monkeypatch):
    """It once said a community node needs a stake to get work while the default hired unstaked ones."""
    stated = f"(`min_stake`, {DEFAULT['min_stake']:g} credits by default"
    use_it = README[README.index("## Use it") : README.index("**Submit your own job**")]
    money = README[README.index("## Money") : README.index("## Dashboard")]
    for section in use_it, money:
        assert stated in " ".join(section.split())
    (variable,) = set(re.findall(r"GPUFLEX_MIN_STAKE=(\d+)", money))
    monkeypatch.setenv("GPUFLEX_MIN_STAKE", variable)
    assert CoordinatorSettings().min_stake == float(variable)


def test_the_offers_help_shows_its_example_query_whole():
    shown = _help("offers")
    assert 'region in [eu, us] hours>=24"' in shown
    assert "[default: online first, cheapest]" in shown


def test_the_readme_starts_every_node_the_example_job_needs():
    workers = load_job_spec(EXAMPLE).resources.workers
    use_it = README[README.index("## Use it") : README.index("**Submit your own job**")]
    assert f"its {workers} workers on {workers} community providers" in " ".join(use_it.split())
    assert "--core" in use_it
    (names,) = re.findall(r"for name in ([^;]+); do", use_it)
    assert len(names.split()) == workers


def test_the_example_job_lists_the_compression_methods_the_spec_accepts():
    line = next(line for line in EXAMPLE.read_text().splitlines() if line.strip().startswith("compression:"))
    listed = line.split("#", 1)[1].split(",")[0]
    assert [method.strip() for method in listed.split("|")] == list(
        get_args(CompressionSpec.model_fields["method"].annotation)
    )
    assert yaml.safe_load(EXAMPLE.read_text())["training"]["compression"] in listed


def test_the_prepared_data_example_runs_as_its_comments_say(tmp_path, monkeypatch):
    """Its `gpuflex data prepare` line, run from the repo root, makes a dataset the example job fits."""
    from gpuflex.data.fit import check_job
    from gpuflex.data.manifest import read_manifest

    root = Path(__file__).parents[2]
    example = root / "examples" / "prepared-data.yaml"
    (line,) = re.findall(r"^#\s+gpuflex (data prepare .*)$", example.read_text(), re.MULTILINE)
    args = shlex.split(line)
    args[args.index("./prepared")] = str(tmp_path / "prepared")
    monkeypatch.chdir(root)
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    spec = load_job_spec(example)
    manifest = read_manifest(tmp_path / "prepared")
    check_job(manifest, spec)
    assert spec.data.prepared == "./prepared"
    assert len(manifest.train) >= 2 * spec.resources.workers  # each worker fetches whole shards of its own


def test_the_smollm2_example_trains_locally_the_job_its_yaml_submits(monkeypatch):
    """Its `gpuflex train local` line builds the training section of the file it stands in (same rounds,
    LoRA, precision, data and workers), so running one is running the other."""
    import gpuflex.cli.train as train_cli

    example = Path(__file__).parents[2] / "examples" / "smollm2-lora.yaml"
    commands = re.sub(r"\\\n#\s+", " ", example.read_text())  # a comment's continued lines, joined
    (line,) = re.findall(r"^#\s+gpuflex (train local .*)$", commands, re.MULTILINE)
    ran = {}

    def run(spec, dataset, code, options, threads, prepared):
        ran.update(spec=spec, workers=len(options), prepared=prepared)
        raise SystemExit(0)  # before any training

    monkeypatch.setattr(train_cli, "_run", run)
    result = CliRunner().invoke(app, shlex.split(line))
    assert result.exit_code == 0, result.output
    job = load_job_spec(example)
    ours, theirs = ran["spec"].model_dump(), job.training.model_dump()
    for spec in (ours, theirs):
        spec["model"]["from"] = Path(spec["model"]["from"])  # ./smollm2-135m-instruct, as a Path has it
    assert ours == theirs
    assert ran["workers"] == job.resources.workers
    assert str(ran["prepared"]) == str(Path(job.data.prepared))


def test_make_install_only_sets_up_the_venv_and_the_readme_names_it(tmp_path):
    make = shutil.which("make")
    if make is None:
        pytest.skip("no make on PATH")
    venv = tmp_path / "venv"
    dry = subprocess.run(
        [make, "-n", "install", f"VENV={venv}"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert dry.returncode == 0, dry.stderr
    assert f"-m venv {venv}" in dry.stdout and f"touch {venv}/.installed" in dry.stdout
    assert "bin/gpuflex" not in dry.stdout and "-m pytest" not in dry.stdout and "ruff" not in dry.stdout
    assert "`make install`" in README[: README.index("## What `make demo` does")]
