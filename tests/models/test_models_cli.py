"""`fleet models …` through its own argparse registration, against a temporary data dir."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from fleet.models.catalog import get_card
from fleet.models.cli import register


def run(capsys: pytest.CaptureFixture[str], data_dir: Path, *argv: str) -> str:
    parser = argparse.ArgumentParser(prog="fleet")
    parser.add_argument("--data-dir", type=Path)
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["--data-dir", str(data_dir), "models", *argv])
    assert args.func(args) == 0
    return capsys.readouterr().out


def _row(output: str, model_id: str) -> list[str]:
    return next(line.split() for line in output.splitlines() if line.startswith(model_id + " "))


def test_list_shows_every_card_and_what_is_on_disk(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
):
    output = run(capsys, tmp_path, "list")

    assert output.splitlines()[0].split() == [
        "ID",
        "TASKS",
        "FAMILY",
        "ON",
        "DISK",
        "SIZE",
        "SOURCE",
    ]
    assert _row(output, "tiny-llm")[:4] == ["tiny-llm", "text_generation", "mlx_lm", "buildable"]
    assert _row(output, "flux1-dev")[3] == "no"
    assert f"models dir: {tmp_path.resolve() / 'models'}" in output


def test_make_tiny_only_llm_then_list_says_yes(capsys: pytest.CaptureFixture[str], tmp_path: Path):
    built = run(capsys, tmp_path, "make-tiny", "--only", "tiny-llm")
    again = run(capsys, tmp_path, "make-tiny", "--only", "tiny-llm")
    listed = run(capsys, tmp_path, "list")

    assert built.startswith("tiny-llm: built in ")
    assert again.startswith("tiny-llm: already at ")
    assert (tmp_path / "models" / "tiny-llm" / "config.json").is_file()
    assert _row(listed, "tiny-llm")[3] == "yes"
    assert _row(listed, "tiny-flux2")[3] == "buildable"


def test_add_prints_the_card_and_list_shows_it(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, tiny_llm_dir: Path
):
    added = run(capsys, tmp_path, "add", "--id", "my-tiny", "--path", str(tiny_llm_dir))
    listed = run(capsys, tmp_path, "list")

    assert ["layers", "2"] in [line.split() for line in added.splitlines()]
    assert _row(listed, "my-tiny")[3] == "yes"
    assert _row(listed, "my-tiny")[-1] == str(tiny_llm_dir.resolve())


def test_add_as_an_embedding_model(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                   tiny_llm_dir: Path):
    added = run(capsys, tmp_path, "add", "--id", "my-embed", "--path", str(tiny_llm_dir),
                "--embeddings")
    assert ["tasks", "embeddings"] in [line.split() for line in added.splitlines()]
    card = get_card("my-embed", tmp_path)
    assert card.is_embedding and card.embedding is not None
    assert (card.embedding.pooling, card.embedding.dimensions) == ("mean", 64)
    assert not card.embedding.truncatable
    run(capsys, tmp_path, "add", "--id", "my-last", "--path", str(tiny_llm_dir),
        "--embeddings", "last")
    assert get_card("my-last", tmp_path).embedding_spec.pooling == "last"


def test_convert_rejects_models_it_cannot_convert(tmp_path: Path):
    parser = argparse.ArgumentParser(prog="fleet")
    register(parser.add_subparsers(dest="command", required=True))

    with pytest.raises(SystemExit):
        parser.parse_args(["models", "convert", "tiny-llm"])
