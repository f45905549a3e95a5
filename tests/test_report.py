"""The paper-shaped tables of the pipeline's report."""

from __future__ import annotations

import pytest

from megasemface.pipeline.report import baseline_of, copy_scores, paper_table
from megasemface.tracking.compare import RunRecord

DIRECTIONS = ["en-de", "de-en"]


def _record(key: str, display: str, en_de: float, de_en: float) -> RunRecord:
    return RunRecord(
        run_id=key,
        name=f"run-{key}",
        experiment="e",
        status="FINISHED",
        start_time_ms=0,
        end_time_ms=1000,
        params={},
        tags={"system_key": key, "system": display},
        metrics={"test_bleu_en-de": en_de, "test_bleu_de-en": de_en},
        tracking_uri="sqlite:///x.db",
    )


RECORDS = [
    _record("transformer", "Transformer", 1.0, 3.0),
    _record("xlm", "XLM", 4.0, 6.0),
    _record("vq", "VQ-SemFace", 6.5, 7.5),
]


def test_gains_are_measured_from_the_papers_baseline_row() -> None:
    assert baseline_of(RECORDS, "supervised").tags["system"] == "Transformer"
    assert baseline_of(RECORDS, "unsupervised").tags["system"] == "XLM"
    assert baseline_of(RECORDS[2:], "unsupervised").tags["system"] == "VQ-SemFace"

    table, values = paper_table(RECORDS, DIRECTIONS, baseline_of(RECORDS, "unsupervised"))
    rows = [line.split(" | ") for line in table.splitlines()[2:]]
    assert [row[-1].rstrip(" |") for row in rows] == ["-3.00", "-", "+2.00"]
    assert values["VQ-SemFace"] == pytest.approx({"en-de": 6.5, "de-en": 7.5, "avg": 7.0})

    table, _ = paper_table(RECORDS, DIRECTIONS)  # default: the first row
    assert table.splitlines()[2].endswith("| 2.00 | - |")


def test_copying_the_source_is_scored_per_direction(tmp_path) -> None:
    prefix = tmp_path / "test"
    (tmp_path / "test.en").write_text("Open file %s\nQuit\nthe cat sat on the mat\n")
    (tmp_path / "test.de").write_text("Open file %s\nBeenden\ndie Katze sass auf der Matte\n")
    scores = copy_scores(prefix, DIRECTIONS)
    assert set(scores) == set(DIRECTIONS)
    assert scores["en-de"] == pytest.approx(scores["de-en"])  # BLEU of one copy either way
    assert 0 < scores["en-de"] < 100
    (tmp_path / "test.de").write_text((tmp_path / "test.en").read_text())
    assert copy_scores(prefix, DIRECTIONS) == pytest.approx({"en-de": 100.0, "de-en": 100.0})


def test_learning_rates_must_be_positive() -> None:
    from megasemface.pipeline.config import PipelineConfig

    for name in ("lr", "pretrain_lr"):
        with pytest.raises(ValueError, match=f"{name} must be > 0"):
            PipelineConfig(**{name: 0.0})
