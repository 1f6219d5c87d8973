"""Tables that fit (issue 22): a table never cuts a number or splits a name, splits into several tables by meaning
when the terminal is too narrow, and `COLUMNS` is honoured in a pipe; statistical wording agrees with the
thresholds used (a p below the test's threshold is never called consistent with i.i.d. shards, an effective count
never exceeds the values it is counted from)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from ddpdoctor.analyses.bn_checks import SampleLayer, layer_effective_samples
from ddpdoctor.bn.stats import NonIIDResult
from ddpdoctor.cli import main
from ddpdoctor.report.layout import GAP, column_groups, layout, report_width

REPO = Path(__file__).resolve().parents[1]
BN_RUN = REPO / "fixtures" / "runs" / "bn_noniid_small"


def test_column_groups_fit_and_repeat_the_key_column():
    widths = [9, 4, 10, 10, 6, 6, 6, 7]
    assert column_groups(widths, 200) == [list(range(8))]
    groups = column_groups(widths, 40)
    assert all(g[0] == 0 for g in groups)
    assert sorted(i for g in groups for i in g[1:]) == list(range(1, 8))  # every column once, in order
    for g in groups:
        assert sum(widths[i] for i in g) + GAP * (len(g) - 1) <= 40
    # sections stay whole when they fit
    assert column_groups([9, 8, 8, 8, 8, 8, 8], 50, sections=[[1, 2, 3], [4, 5, 6]]) == [[0, 1, 2, 3], [0, 4, 5, 6]]


def test_layout_shrinks_by_wrapping_at_spaces_never_below_a_word():
    headers = ["layer", "mean vs SyncBN (std)", "value"]
    rows = [["block.bn1", "0.013", "1.8e-05"]]
    ((group, widths),) = layout(headers, rows, 40)
    assert group == [0, 1, 2] and widths is not None
    assert widths[0] >= len("block.bn1") and widths[1] >= len("SyncBN") and widths[2] >= len("1.8e-05")
    assert sum(widths) + GAP * 2 <= 40


@pytest.mark.parametrize("columns", [50, 60, 80, 100])
def test_bn_table_fits_and_keeps_every_cell_whole(capsys, monkeypatch, columns):
    monkeypatch.setenv("COLUMNS", str(columns))
    code = main(["report", str(BN_RUN)])
    out = capsys.readouterr().out
    assert code in (0, 1)
    assert max(len(line) for line in out.splitlines()) <= columns
    assert "…" not in out
    table = json.loads(_json(capsys))["tables"]["batchnorm"]
    section = out[out.index(table["title"][:30]):]
    tokens = set(re.findall(r"\S+", section))
    for row in table["rows"]:
        for cell in row:
            for word in str(cell).split():
                assert word in tokens, (columns, word)


def _json(capsys) -> str:
    main(["report", str(BN_RUN), "--format", "json"])
    return capsys.readouterr().out


def test_columns_is_honoured_in_a_pipe(capsys, monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    assert report_width(False, 100) == 100
    main(["report", str(BN_RUN)])
    wide = capsys.readouterr().out
    assert max(len(line) for line in wide.splitlines()) > 80
    monkeypatch.setenv("COLUMNS", "80")
    assert report_width(False, 100) == 80
    main(["report", str(BN_RUN)])
    assert max(len(line) for line in capsys.readouterr().out.splitlines()) <= 80


def test_bn_table_p_values_keep_their_figures_and_the_decision_is_explained(capsys):
    doc = json.loads(_json(capsys))
    table = doc["tables"]["batchnorm"]
    assert all(row[-1] not in ("0.00", "0.0") for row in table["rows"])
    assert "Combined over layers p = " in table["caption"]


class _Arm:
    ctx = SimpleNamespace(ranks={})  # a run with no recorded inputs: not one fixed batch

    @staticmethod
    def has(code):
        return []


@pytest.mark.parametrize("p, words", [(8.7e-05, "differ detectably"), (0.42, "consistent with i.i.d. shards")])
def test_triage_noniid_wording_agrees_with_the_threshold(monkeypatch, p, words):
    from ddpdoctor.triage import measures

    result = NonIIDResult(method="m", statistic=1.0, p_value=p, layer="bn", channel=0, ranks=2, steps=4)
    monkeypatch.setattr(measures.bc, "noniid_for", lambda ctx: result)
    cause = measures.noniid_cause(_Arm())
    assert words in cause.message
    if p < result.threshold:
        assert "consistent" not in cause.message
    assert cause.measured["summary"] == ("p = 8.7e-05" if p < 1e-3 else "p = 0.42")


def test_effective_count_is_bounded_by_the_values_averaged():
    # a batch mean of 4 values per channel whose sample means vary far less than the values: the raw estimate
    # is far above 4 (noise), the reported count is not
    layer = SampleLayer("bn", {0: {"samples": [4] * 6, "count": [4] * 6, "tv": [np.full(3, 1.0)] * 6,
                                   "bv": [np.full(3, 1e-4)] * 6}})
    got = layer_effective_samples(layer)[0]
    assert got["n_eff"] == 4.0 and got["hi"] <= 4.0 and got["lo"] <= 4.0
