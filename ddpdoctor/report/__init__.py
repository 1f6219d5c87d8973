"""Reports: the ranked, filtered list of findings plus context, rendered as text, JSON or SARIF."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddpdoctor import __version__
from ddpdoctor.findings import Finding, Severity, rank_findings, summarize

REPORT_SCHEMA = "ddpdoctor.report/1"


@dataclass(frozen=True, kw_only=True)
class Report:
    script: str
    args: tuple[str, ...] = ()
    environment: dict[str, Any] = field(default_factory=dict)
    findings: tuple[Finding, ...] = ()
    notes: tuple[str, ...] = ()  # one-line remarks for the text report (e.g. "CUDA was emulated on CPU")
    tables: dict[str, Any] = field(default_factory=dict)  # extra tables for the text report (e.g. BN errors)
    base_dir: Path | None = None  # what relative finding paths are relative to (the user's cwd of the run)
    # `ddpdoctor triage`: the JSON `triage` object (SPEC "triage"), and what only the text report shows
    triage: dict[str, Any] | None = None
    triage_text: dict[str, Any] = field(default_factory=dict)
    measured: bool = True  # False: a triage whose arms measured nothing (it claims nothing, and exits non-zero)

    def ranked(self) -> list[Finding]:
        return rank_findings(self.findings)

    def to_json(self) -> dict[str, Any]:
        ranked = self.ranked()
        out: dict[str, Any] = {
            "schema": REPORT_SCHEMA,
            "tool": {"name": "ddpdoctor", "version": __version__},
            "target": {"script": self.script, "args": list(self.args)},
            "environment": self.environment,
            "findings": [f.to_json() for f in ranked],
            "summary": summarize(ranked),
        }
        if self.notes:
            out["notes"] = list(self.notes)
        if self.tables:
            out["tables"] = self.tables
        if self.triage is not None:
            out["triage"] = self.triage
        return out

    def __getitem__(self, key: str) -> Any:
        """Dict access to the JSON document: `report["findings"][0]["rule"]`, `report["summary"]`."""
        return self.to_json()[key]

    def _repr_markdown_(self) -> str:
        """Jupyter shows a report as its `--format markdown` rendering."""
        from ddpdoctor.report.markdown import render_markdown

        return render_markdown(self)

    def exit_code(self, fail_on: Severity | None = Severity.MEDIUM) -> int:
        """1 when a finding is at or above `fail_on` (None: never, as `--exit-zero`), else 0."""
        if fail_on is None:
            return 0
        if not self.measured:
            return 1  # a triage that measured nothing never passes a gate
        return 1 if any(f.severity >= fail_on for f in self.findings) else 0
