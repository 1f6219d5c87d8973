"""DD302's fix: the training DataLoader gets a DistributedSampler (in place of shuffle=True or the single-process
sampler), and the epoch loop calls its set_epoch."""

from __future__ import annotations

import ast

from ddpdoctor.findings import Finding
from ddpdoctor.fixes.engine import Code, NoFix, Patch, keyword

CODE = "DD302"
MEASURE = "overlap_fraction"


def _named(loader: str, what: str) -> str:
    return loader.replace("loader", what) if "loader" in loader else f"{loader}_{what}"


def fix(finding: Finding, code: Code) -> Patch:
    ev = finding.evidence
    call = next(iter(code.calls(ev.get("loader_line"), "DataLoader")), None)
    if call is None:
        raise NoFix("the DataLoader is not built on the finding's line")
    stmt = code.statement(call)
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)):
        raise NoFix("the DataLoader is not assigned to a name")
    loader = stmt.targets[0].id
    scope = code.scope(stmt)
    dataset_kw = keyword(call, "dataset")
    dataset_node = dataset_kw.value if dataset_kw is not None else (call.args[0] if call.args else None)
    if dataset_node is None:
        raise NoFix("the DataLoader's dataset is not passed")
    before: list[str] = []
    edits = []
    if isinstance(dataset_node, ast.Name):
        dataset = dataset_node.id
    else:  # `DataLoader(make_data(), ...)`: the dataset gets a name, the sampler needs it too
        dataset = code.fresh(_named(loader, "dataset"), scope)
        before.append(f"{dataset} = {code.segment(dataset_node)}")
        edits.append(code.replace(dataset_node, dataset))
    shuffle, sampler_kw = keyword(call, "shuffle"), keyword(call, "sampler")
    cls = "DistributedSampler"
    imp = code.add_import("from torch.utils.data.distributed import DistributedSampler", cls)
    sampler = code.fresh(_named(loader, "sampler"), scope)
    before.append(f"{sampler} = {cls}({dataset})")
    if sampler_kw is not None:
        if shuffle is not None:
            raise NoFix("the DataLoader passes both shuffle and sampler")
        edits.append(code.replace(sampler_kw.value, sampler))
    elif shuffle is not None:
        edits.append(code.replace(shuffle, f"sampler={sampler}"))  # the sampler shuffles (its default)
    else:
        last = (call.keywords or call.args)[-1]
        edits.append(code.insert_at(*code.end(last), f", sampler={sampler}"))
    edits.append(code.insert_lines_before(stmt.lineno, before))
    if imp is not None:
        edits.append(imp)
    summary = f"shard `{loader}` with a DistributedSampler"
    try:
        loop, epoch = code.epoch_loop(ev.get("loop_line") or 0, inner=True)
        if code.scope(loop) is not scope:
            raise NoFix("the epoch loop is in another function than the DataLoader")
        edits.append(code.first_in_body(loop.body, [f"{sampler}.set_epoch({epoch})"]))
        summary += f" and call {sampler}.set_epoch({epoch}) every epoch"
    except NoFix as exc:
        summary += f" (set_epoch not added: {exc})"
    return Patch(rule=CODE, line=finding.line, edits=tuple(edits), summary=summary)
