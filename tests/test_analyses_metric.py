"""DD504 (unreduced evaluation metric) replayed from a recorded run (fixtures/runs/metric_*, recorded with
`ddpdoctor check fixtures/probe/metrics/NAME.py --keep-run fixtures/runs/metric_NAME`)."""

from __future__ import annotations

from pathlib import Path

from ddpdoctor.check import report_run

RUNS = Path(__file__).resolve().parent.parent / "fixtures" / "runs"


def test_dd504_a_training_loss_reduced_after_the_next_step_does_not_clear_the_unreduced_metric() -> None:
    """Issue 20: the evaluation's correct-counts are never reduced and rank 0 prints its shard's accuracy; the next
    epoch all-reduces a training loss for logging. That collective comes after the evaluation loop but after the
    next optimizer step too: it reduced nothing of the metric, so the static DD504 stays (it was cleared)."""
    report = report_run(RUNS / "metric_eval_unreduced_train_loss_reduced")
    (f,) = [f for f in report.findings if f.rule == "DD504"]
    assert f.line == 19 and f.evidence["eval_loop_line"] == 16
    assert not any("static DD504" in n and "cleared" in n for n in report.notes), report.notes
