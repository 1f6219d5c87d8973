"""The static event schema (ddpdoctor/static/events.py) is the contract between the interpreter and the rules: every
kind the interpreter emits is documented with exactly the fields it carries, and every documented kind and field is
produced somewhere — on the fixtures, or on the small script below that exercises the rarer models."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from ddpdoctor.errors import UsageError
from ddpdoctor.plain import fields_of
from ddpdoctor.static import build_model
from ddpdoctor.static.events import EVENT_FIELDS, STATIC_EVENT_KINDS
from ddpdoctor.static.semantic import Event

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"

RARE = textwrap.dedent(
    """
    import argparse, logging, os
    import multiprocessing as mp
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

    parser = argparse.ArgumentParser()
    parser.add_argument("--lr", type=float, default=0.1)
    parser.set_defaults(epochs=3)
    args = parser.parse_args()

    def worker(q):
        if "RANK" in os.environ:
            os.environ["MASTER_PORT"] = "29500"
        dist.init_process_group("gloo")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        layer = nn.SyncBatchNorm(8)
        loss = layer(torch.randn(4, 8)).sum() * dist.get_world_size()
        if dist.get_rank() == 0:
            dist.send(torch.zeros(1), dst=1)
        else:
            dist.recv(torch.zeros(1), src=0)
        opt = torch.optim.SGD(layer.parameters(), lr=args.lr)
        sched = torch.optim.lr_scheduler.StepLR(opt, 1)
        self_optimizer = make_optimizer()
        self_optimizer.step()
        sched.step()
        state = torch.load("ckpt.pt")
        consume_prefix_in_state_dict_if_present(state, "module.")
        something.eval()
        logging.info("done")

    mp.Process(target=worker, args=(None,)).start()
    """
)


def _corpus() -> list[tuple[str, list[Event]]]:
    out = [("<rare>", build_model(RARE, "rare.py").events)]
    for path in sorted(FIXTURES.rglob("*.py")):
        try:
            out.append(
                (str(path.relative_to(FIXTURES)), build_model(path.read_text(encoding="utf-8"), str(path)).events)
            )
        except UsageError:
            continue  # fixtures of unreadable scripts
    return out


@pytest.fixture(scope="module")
def corpus() -> list[tuple[str, list[Event]]]:
    return _corpus()


def test_every_emitted_kind_and_field_is_documented(corpus) -> None:
    problems: set[str] = set()
    for name, events in corpus:
        for ev in events:
            kind = STATIC_EVENT_KINDS.get(ev.kind)
            if kind is None:
                problems.add(f"{name}: undocumented kind {ev.kind}")
                continue
            extra = set(ev.data) - set(kind.fields)
            if extra:
                problems.add(f"{name}: {ev.kind} has undocumented {sorted(extra)}")
            missing = set(kind.fields) - kind.optional - set(ev.data)
            if missing:
                problems.add(f"{name}: {ev.kind} lacks {sorted(missing)}")
    assert sorted(problems) == []


def test_every_documented_kind_and_field_is_produced(corpus) -> None:
    seen: dict[str, set[str]] = {}
    for _, events in corpus:
        for ev in events:
            seen.setdefault(ev.kind, set()).update(ev.data)
    assert sorted(set(STATIC_EVENT_KINDS) - set(seen)) == [], "documented kinds nothing emits"
    unproduced = {
        k: sorted(set(kind.fields) - seen[k]) for k, kind in STATIC_EVENT_KINDS.items() if set(kind.fields) - seen[k]
    }
    assert unproduced == {}


def test_event_attributes_are_the_documented_ones() -> None:
    attributes = set(fields_of(Event)) - {"data"}
    assert attributes == set(EVENT_FIELDS)
    for kind in STATIC_EVENT_KINDS.values():
        assert kind.doc and all(kind.fields.values()), kind.kind
        assert kind.optional <= set(kind.fields), kind.kind


def test_fast_constructors_set_every_field_as_the_class_call_does() -> None:
    """`new_obj`, `Event.made` and `Args.none` set the slots directly (the walk's hot path): each field the class's
    own `__init__` sets, to the same value."""
    from ddpdoctor.static.engine.support import Args
    from ddpdoctor.static.semantic import Obj, new_obj

    fields = ("k", 3, None, "f.py", "q", "l", frozenset({"rank"}), True, 7, None, None, None, None)
    made, called = new_obj(*fields), Obj("k", 3, None, "q", "l", frozenset({"rank"}), True, 7, file="f.py")
    assert [getattr(made, n) for n in fields_of(Obj)] == [getattr(called, n) for n in fields_of(Obj)]
    ev = ("call", None, 4, 1, (), (1,), "main", True, {"a": 1}, "f.py", ())
    assert repr(Event.made(*ev)) == repr(Event(*ev))
    assert Args.none() == Args() and vars(Args.none()) == vars(Args())
