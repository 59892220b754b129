import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from gpuflex.errors import SpecError
from gpuflex.protocol.deployment import DeploymentSpec
from gpuflex.protocol.spec import describe_validation_error, job_spec_from_yaml, load_job_spec, parse_job_spec

EXAMPLE = Path(__file__).parents[2] / "src" / "gpuflex" / "examples" / "char-gpt.yaml"


def test_the_shipped_example_is_valid():
    spec = load_job_spec(EXAMPLE)
    assert spec.resources.workers == 3
    assert spec.training.recipe == "char-gpt"
    assert spec.data.source == "stdlib"


def test_defaults_fill_everything_but_the_name():
    spec = parse_job_spec({"name": "tiny"})
    assert spec.training.outer_lr == 0.7 and spec.training.outer_momentum == 0.9
    assert (spec.resources.min_core_workers, spec.resources.core_fallback) == (0, True)


def test_a_job_can_ask_for_core_workers_and_forbid_core_fallback():
    spec = job_spec_from_yaml("name: x\nresources: {workers: 3, min_core_workers: 3, core_fallback: false}")
    assert (spec.resources.min_core_workers, spec.resources.core_fallback) == (3, False)


def test_pricing_is_fixed_unless_the_job_asks_for_an_auction():
    assert parse_job_spec({"name": "x"}).pricing == "fixed"
    assert job_spec_from_yaml("name: x\npricing: auction").pricing == "auction"


def test_an_auction_does_not_combine_with_a_core_quota():
    with pytest.raises(SpecError) as err:
        job_spec_from_yaml("name: x\npricing: auction\nresources: {workers: 2, min_core_workers: 1}")
    assert "pricing 'auction' does not combine with resources.min_core_workers > 0" in err.value.message


def test_the_core_quota_cannot_exceed_the_workers():
    with pytest.raises(SpecError) as err:
        job_spec_from_yaml("name: x\nresources: {workers: 2, min_core_workers: 3}")
    assert err.value.message == (
        "invalid job spec: resources: Value error, min_core_workers (3) must be at most workers (2)"
    )


def test_min_workers_defaults_to_all_the_workers_and_never_exceeds_them():
    assert job_spec_from_yaml("name: x\nresources: {workers: 3}").resources.min_workers is None  # all 3
    assert job_spec_from_yaml("name: x\nresources: {workers: 3, min_workers: 2}").resources.min_workers == 2
    with pytest.raises(SpecError) as err:
        job_spec_from_yaml("name: x\nresources: {workers: 2, min_workers: 3}")
    assert err.value.message == (
        "invalid job spec: resources.min_workers: Value error, min_workers (3) must be at most workers (2)"
    )


@pytest.mark.parametrize(
    ("yaml_text", "named"),
    [
        ("name: x\ntraining: {roundz: 3}", "training.roundz: unknown field (did you mean rounds?)"),
        ("nmae: x", "nmae: unknown field (did you mean name?)"),
        (
            "name: x\ntraining: {model: {form: ./m}}",
            "training.model.form: unknown field (did you mean from?)",
        ),
        (
            "name: x\ntraining: {lora: {rank: 8}}",
            "training.lora.rank: unknown field (known: r, alpha, dropout, target_modules)",
        ),
        ("name: x\nresources: {workers: 0}", "resources.workers"),
        ("name: x\nresources: {min_core_workers: -1}", "resources.min_core_workers"),
        ("name: x\nresources: {min_workers: 0}", "resources.min_workers: Input should be greater than"),
        ("name: x\nresources: {workers: 0, min_workers: 1}", "resources.workers"),
        ("name: x\nresources: {core_fallback: maybe}", "resources.core_fallback"),
        ("name: x\ntraining: {compression: zip}", "training.compression"),
        ("name: x\ntraining: {inner_optimizer: sgd}", "training.inner_optimizer: Input should be 'adamw' or"),
        (
            "name: x\ntraining: {inner_optimizer: muon, recipe: hf-causal-lm, lora: {r: 4}}",
            "training: Value error, inner_optimizer 'muon' trains whole weight matrices; LoRA's adapters",
        ),
        ("name: x\nbudget: -1", "budget"),
        ("name: x\ntraining: {model: {n_embd: 30, n_head: 4}}", "training.model"),
        ("name: 'bad name!'", "name"),
        ("resources: {workers: 2}", "name: Field required"),
        ("name: x\nmax_price_per_hour: cheap", "max_price_per_hour"),
        ("name: x\npricing: dutch", "pricing: Input should be 'fixed' or 'auction'"),
        ("name: x\npricing: {mode: auction}", "pricing"),
    ],
)
def test_bad_fields_are_named(yaml_text, named):
    with pytest.raises(SpecError) as err:
        job_spec_from_yaml(yaml_text)
    assert named in err.value.message


def test_an_unknown_deployment_field_is_named_with_the_closest_known_one():
    with pytest.raises(ValidationError) as err:
        DeploymentSpec.model_validate({"name": "x", "model": {"job": "j-1", "form": "."}, "replica": 2})
    assert describe_validation_error(err.value, DeploymentSpec) == (
        "model.form: unknown field (did you mean from?); replica: unknown field (did you mean replicas?)"
    )


def test_malformed_yaml_and_non_mappings_are_refused(tmp_path):
    with pytest.raises(SpecError, match="not valid YAML"):
        job_spec_from_yaml("name: [unclosed")
    with pytest.raises(SpecError, match="mapping"):
        job_spec_from_yaml("- a list")
    with pytest.raises(SpecError, match="cannot read"):
        load_job_spec(tmp_path / "missing.yaml")


def test_data_is_a_source_or_a_prepared_dataset_and_either_survives_a_round_trip():
    assert parse_job_spec({"name": "x"}).data.source == "stdlib"
    prepared = parse_job_spec({"name": "x", "data": {"prepared": "./prepared"}})
    assert (prepared.data.source, prepared.data.prepared) == (None, "./prepared")
    for spec in (prepared, parse_job_spec({"name": "x", "data": {"source": "./text"}})):
        assert parse_job_spec(spec.model_dump(mode="json")) == spec  # as the coordinator reads it back


@pytest.mark.parametrize(
    ("data", "training", "message"),
    [
        (
            {"source": "stdlib", "prepared": "./p"},
            {},
            "data: Value error, give one of data.source, data.prepared and data.federated, "
            "not source and prepared",
        ),
        (
            {"prepared": "./p"},
            {"recipe": "mlp-digits"},
            "data.prepared trains a token model: recipe char-gpt or hf-causal-lm, not mlp-digits",
        ),
        (
            {"prepared": "./p"},
            {"local_devices": 2},
            "data.prepared does not combine with training.local_devices > 1",
        ),
    ],
)
def test_a_prepared_dataset_is_refused_where_it_cannot_work(data, training, message):
    with pytest.raises(SpecError, match=re.escape(message)):
        parse_job_spec({"name": "x", "data": data, "training": training})


def _federated(**extra):
    return {"name": "f", "data": {"federated": "notes"}, **extra}


def test_a_federated_job_names_a_dataset_and_is_unaudited_by_default():
    spec = parse_job_spec(_federated())
    assert (spec.data.federated, spec.data.source, spec.data.prepared) == ("notes", None, None)
    v = spec.training.verification
    assert (v.robust, v.audit_rate, v.peer_segments) == (False, 0.0, 0)
    assert parse_job_spec(spec.model_dump(mode="json")) == spec  # as the coordinator stores it
    # its workers are its owners: min_workers alone asks for no more than the default workers
    assert parse_job_spec(_federated(resources={"min_workers": 3})).resources.min_workers == 3


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ({"name": "f", "data": {"federated": "notes", "source": "stdlib"}}, "give one of data.source"),
        ({"name": "f", "data": {"federated": "notes", "prepared": "./p"}}, "give one of data.source"),
        (_federated(training={"verification": {"robust": True}}), "cannot be audited or screened"),
        (_federated(training={"verification": {"audit_rate": 0.1}}), "cannot be audited or screened"),
        (_federated(training={"recipe": "mlp-digits"}), "data.federated trains a token model"),
        (_federated(pricing="auction"), "one worker on each owner: no auction"),
        ({"name": "f", "data": {"federated": "no spaces"}}, "data.federated: String should match"),
    ],
)
def test_bad_federated_specs_are_refused_naming_the_problem(spec, says):
    with pytest.raises(SpecError) as err:
        parse_job_spec(spec)
    assert says in err.value.message, err.value.message


@pytest.mark.parametrize(
    "extra",
    [
        {"data": {"source": "./text"}},
        {"data": {"prepared": "./p"}},
        {"data": {"federated": "notes"}},
        {"training": {"recipe": "hf-causal-lm", "model": {"from": "./model"}}},
    ],
)
def test_encrypt_covers_uploaded_data_a_model_directory_and_federated_jobs(extra):
    assert parse_job_spec({"name": "s", "privacy": {"encrypt": True}, **extra}).privacy.encrypt
