"""Fix lines in the script's own names (issue 22): `Save model.module.state_dict()` where the script's DDP wrapper
is called `model`, not the catalog's generic `ddp`; the catalog's own text stays generic."""

from __future__ import annotations

from pathlib import Path

import pytest

from ddpdoctor.check import run_check
from ddpdoctor.config import CheckConfig
from ddpdoctor.findings import Confidence, Finding, merge_findings, new_finding
from ddpdoctor.rules import get_rule

SCRIPT = """\
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
net = torch.nn.Linear(4, 4)
{wrapper} = DDP(net)
opt = torch.optim.SGD({wrapper}.parameters(), lr=0.1)
for step in range(10):
    loss = {wrapper}(torch.randn(2, 4)).sum()
    loss.backward()
    if step % 4 == 3:
        opt.step()
        opt.zero_grad()
if int(os.environ["RANK"]) == 0:
    torch.save({wrapper}.state_dict(), "ckpt.pt")
"""


@pytest.mark.parametrize("wrapper", ["model", "ddp_model", "ddp"])
def test_static_fixes_name_the_scripts_wrapper(tmp_path: Path, wrapper: str) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(wrapper=wrapper), encoding="utf-8")
    found = {f.rule: f for f in run_check(CheckConfig(script=script, static_only=True)).findings}
    assert found["DD501"].fix.startswith(f"Save {wrapper}.module.state_dict();")
    assert found["DD403"].fix.endswith(f"under {wrapper}.no_sync().")
    assert get_rule("DD501").fix.startswith("Save ddp.module.state_dict();")  # the catalog stays generic


def test_only_plain_names_replace_and_only_where_used_as_code() -> None:
    rule = get_rule("DD501")
    assert rule.named(rule.fix, {"wrapper": "self.model"}).startswith("Save self.model.module.state_dict()")
    for odd in ("`DistributedDataParallel(...)`", "models[0]", "", None, 3):
        assert rule.named(rule.fix, {"wrapper": odd}) == rule.fix
    assert rule.named("the ddp wrapper: ddp.module", {"wrapper": "net"}) == "the ddp wrapper: net.module"


def test_a_merged_finding_keeps_the_static_name() -> None:
    static = new_finding("DD501", sources=("static",), message="m", confidence=Confidence.LIKELY, file="t.py",
                         line=9, evidence={"wrapper": "model"})
    probe = new_finding("DD501", sources=("probe",), message="m", confidence=Confidence.CERTAIN, file="t.py",
                        line=9, evidence={"saves": 1})
    assert probe.fix == get_rule("DD501").fix
    (merged,) = merge_findings([static, probe])
    assert isinstance(merged, Finding) and merged.fix.startswith("Save model.module.state_dict()")


def test_dd302_fix_names_the_loaders_dataset(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(
        "import torch\nimport torch.distributed as dist\n"
        "from torch.nn.parallel import DistributedDataParallel as DDP\n"
        "from torch.utils.data import DataLoader, TensorDataset\n\n"
        "dist.init_process_group('gloo')\n"
        "train_set = TensorDataset(torch.randn(64, 4), torch.randn(64, 4))\n"
        "train_loader = DataLoader(train_set, batch_size=8, shuffle=True)\n"
        "model = DDP(torch.nn.Linear(4, 4))\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "for x, y in train_loader:\n"
        "    loss = (model(x) - y).pow(2).mean()\n"
        "    opt.zero_grad()\n"
        "    loss.backward()\n"
        "    opt.step()\n", encoding="utf-8")
    (f,) = [f for f in run_check(CheckConfig(script=script, static_only=True)).findings if f.rule == "DD302"]
    assert "DataLoader(train_set, sampler=DistributedSampler(train_set), ...)" in f.fix
    assert f.evidence["loader"] == "train_loader" and f.line == 8
