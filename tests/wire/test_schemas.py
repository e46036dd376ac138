"""schemas/: the committed JSON Schemas match the models, drift is caught, examples validate."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest
from pydantic import ValidationError

from fleet.wire import codec, tasks
from fleet.wire.examples import NATS_CLI_TASK
from fleet.wire.schemas import FAMILIES, drift, render, write

REPO = Path(__file__).resolve().parents[2]
SCHEMAS = REPO / "schemas"
FLEET = Path(sys.executable).parent / "fleet"
EXAMPLE_FILES = sorted((SCHEMAS / "examples").glob("*.json"))


def run_fleet(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(FLEET), *args], cwd=REPO, capture_output=True, text=True, timeout=60, check=False
    )


@pytest.fixture
def schemas_copy(tmp_path: Path) -> Path:
    copy = tmp_path / "schemas"
    shutil.copytree(SCHEMAS, copy)
    return copy


def families_of(example: Any) -> list[str]:
    """The message families whose model accepts this JSON."""
    found = []
    for family, adapter in FAMILIES.items():
        try:
            adapter.validate_python(example)
        except ValidationError:
            continue
        found.append(family)
    return found


# ---- drift ---------------------------------------------------------------------------------

def test_committed_schemas_match_the_models() -> None:
    assert drift(SCHEMAS) == []


def test_fleet_schemas_check_passes_on_the_committed_files() -> None:
    result = run_fleet("schemas", "--check")
    assert result.returncode == 0, result.stderr
    assert "matches the models" in result.stdout


def test_a_changed_schema_file_is_drift(schemas_copy: Path) -> None:
    path = schemas_copy / "task.schema.json"
    schema = orjson.loads(path.read_bytes())
    schema["title"] = "Something else"
    path.write_bytes(orjson.dumps(schema))
    assert drift(schemas_copy) == ["task.schema.json"]


def test_fleet_schemas_check_exits_non_zero_and_names_the_drifted_file(
    schemas_copy: Path,
) -> None:
    (schemas_copy / "examples" / "token.json").write_text('{"type": "token"}\n')
    result = run_fleet("schemas", "--check", "--dir", str(schemas_copy))
    assert result.returncode == 1
    assert "examples/token.json" in result.stderr
    assert "run `fleet schemas`" in result.stderr


def test_a_missing_file_is_drift(schemas_copy: Path) -> None:
    (schemas_copy / "output-event.schema.json").unlink()
    assert drift(schemas_copy) == ["output-event.schema.json"]


def test_a_stale_leftover_file_is_drift(schemas_copy: Path) -> None:
    (schemas_copy / "examples" / "retired_message.json").write_text("{}\n")
    assert drift(schemas_copy) == ["examples/retired_message.json"]


def test_write_repairs_drift_and_then_writes_nothing(schemas_copy: Path) -> None:
    (schemas_copy / "task.schema.json").write_text("{}\n")
    (schemas_copy / "examples" / "image.json").unlink()
    assert sorted(write(schemas_copy)) == ["examples/image.json", "task.schema.json"]
    assert drift(schemas_copy) == []
    assert write(schemas_copy) == []


def test_fleet_schemas_writes_every_file_into_an_empty_dir(tmp_path: Path) -> None:
    result = run_fleet("schemas", "--dir", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr
    assert f"wrote {len(render())} file(s)" in result.stdout
    assert drift(tmp_path / "out") == []


def test_every_family_has_a_schema_file_with_its_id() -> None:
    for family in FAMILIES:
        schema = orjson.loads((SCHEMAS / f"{family}.schema.json").read_bytes())
        assert schema["$id"].endswith(f"/{family}.schema.json")


# ---- examples ------------------------------------------------------------------------------

def test_there_is_an_example_for_every_family() -> None:
    covered = {f for path in EXAMPLE_FILES for f in families_of(orjson.loads(path.read_bytes()))}
    # A runner status never travels alone: it is nested in a record, an event or a report.
    assert covered | {"runner-status"} == set(FAMILIES)


@pytest.mark.parametrize("stem", ["runner_record", "runner_status_changed", "runner_status"])
def test_nested_runner_statuses_validate_against_the_runner_status_schema(stem: str) -> None:
    jsonschema_rs = pytest.importorskip("jsonschema_rs")
    schema = orjson.loads((SCHEMAS / "runner-status.schema.json").read_bytes())
    status = orjson.loads((SCHEMAS / "examples" / f"{stem}.json").read_bytes())["status"]
    validator = jsonschema_rs.validator_for(schema)
    assert validator.is_valid(status)
    assert not validator.is_valid({**status, "state": "dreaming"})


@pytest.mark.parametrize("path", EXAMPLE_FILES, ids=lambda p: p.stem)
def test_every_example_is_accepted_by_its_familys_model(path: Path) -> None:
    assert families_of(orjson.loads(path.read_bytes())), f"no family accepts {path.name}"


@pytest.mark.parametrize("path", EXAMPLE_FILES, ids=lambda p: p.stem)
def test_every_example_validates_against_its_familys_json_schema(path: Path) -> None:
    jsonschema_rs = pytest.importorskip("jsonschema_rs")
    example = orjson.loads(path.read_bytes())
    for family in families_of(example):
        schema = orjson.loads((SCHEMAS / f"{family}.schema.json").read_bytes())
        errors = [e.message for e in jsonschema_rs.validator_for(schema).iter_errors(example)]
        assert errors == [], f"{path.name} against {family}: {errors}"


def test_the_json_schema_rejects_an_unknown_field_as_the_codec_does() -> None:
    jsonschema_rs = pytest.importorskip("jsonschema_rs")
    schema = orjson.loads((SCHEMAS / "task.schema.json").read_bytes())
    example = orjson.loads((SCHEMAS / "examples" / "nats-cli-task.json").read_bytes())
    validator = jsonschema_rs.validator_for(schema)
    assert validator.is_valid(example)
    assert not validator.is_valid({**example, "temprature": 0.5})
    assert not validator.is_valid({**example, "model": "smollm2.135m"})


def test_nats_cli_task_example_decodes_as_a_task() -> None:
    task = codec.decode_task((SCHEMAS / "examples" / "nats-cli-task.json").read_bytes())
    assert isinstance(task, tasks.TextGeneration)
    assert task == NATS_CLI_TASK
    assert task.model == "smollm2-135m"


def test_the_readmes_nats_pub_commands_decode() -> None:
    readme = (REPO / "README.md").read_text()
    published = dict(re.findall(r"nats pub (?:-J )?(\S+) '(\{.*?\})'", readme))
    task = codec.decode_task(published["fleet.tasks.smollm2-135m"].encode())
    assert task == NATS_CLI_TASK
    cancel = codec.decode_model(tasks.CancelTask, published["fleet.cancel.hello-1"].encode())
    assert cancel.task_id == task.task_id
