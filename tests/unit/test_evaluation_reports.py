"""A run's evaluations side by side (trainer/evaluation.py, trainer/metrics.py): the base model first,
then each checkpoint by its step, in a table and in eval.png."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainer.evaluation import comparison_table, label_step, read_reports
from trainer.metrics import plot_evaluations


def report(greedy: float, sampled: float, at_k: float) -> dict:
    return {"tasks": 4, "k": 4, "greedy_pass_at_1": greedy, "sampled_pass_at_1": sampled, "pass_at_k": at_k}


def test_reports_read_base_first_then_by_step_and_compare_in_one_table(tmp_path: Path):
    folder = tmp_path / "eval"
    folder.mkdir()
    written = {"step-10": report(0.75, 0.5, 1.0), "base": report(0.0, 0.125, 0.25), "step-2": report(0.25, 0.25, 0.5)}
    for label, body in written.items():
        (folder / f"{label}.json").write_text(json.dumps(body))
    (folder / "notes.json").write_text("{}")  # not a report of the run: passed over
    reports = read_reports(folder)
    assert [label for label, _ in reports] == ["base", "step-2", "step-10"]
    lines = comparison_table(reports).splitlines()
    assert lines[0].split() == ["base", "step-2", "step-10"]
    assert lines[1].split() == ["greedy", "pass@1", "0.000", "0.250", "0.750"]
    assert lines[2].split() == ["sampled", "pass@1", "0.125", "0.250", "0.500"]
    assert lines[3].split() == ["pass@4", "0.250", "0.500", "1.000"]
    plot_evaluations(reports, tmp_path / "eval.png")
    assert (tmp_path / "eval.png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize("label", ["step-", "step-x", "final", "steps-3"])
def test_a_label_names_the_base_model_or_a_step(label):
    assert label_step("base") == 0 and label_step("step-12") == 12
    with pytest.raises(ValueError, match="labelled 'base' or 'step-N'"):
        label_step(label)
