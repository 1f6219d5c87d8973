"""DD904 nothing-observed: the rule's catalog entry, its documentation and its parameters.

How it is found lives beside this file: static.py (from the source) and probe.py (from a recorded run).
"""

from __future__ import annotations

from ddpdoctor.levels import Severity
from ddpdoctor.rules.rule import Rule, prose, snippet

CODE = "DD904"

RULE = Rule(
    package=__name__,
    code=CODE,
    name="nothing-observed",
    severity=Severity.HIGH,
    summary="the probe observed no optimizer step (resumed past the last epoch, empty loader, early exit, a timeout "
    "before the first step), or the "
    "training loop runs in an engine static analysis does not model (\"not analysed: <engine>\"): what needs "
    "training steps could not be checked, and the report says why",
    what=prose(
        """
        Static analysis says "not analysed: <engine>" where the training loop runs inside an engine it does not
        model (DeepSpeed's `deepspeed.initialize`, Lightning's strategy="deepspeed", ColossalAI), or where the
        script hands its model to an unknown trainer (`trainer.fit(model)` on an object of an imported package)
        and no optimizer step or backward pass is in sight: the rules read the training loop, so there "no
        findings" would mean "not looked at". Lightning's Trainer, Accelerate and the Hugging Face Trainer are
        modelled (README "Frameworks"). A probe run that observed optimizer steps measured the training, and
        drops the static note.

        The probe fires when the script ran to its end without a single optimizer step on any rank, and
        neither a failure (DD902) nor a hang (DD901) explains it; and when the probe's timeout ended a run that
        was slow, not hung, before any rank's first optimizer step (start-up and a first step that take longer
        than --timeout on a loaded machine or a large model). The message says why, as far as the run
        shows it: the script loaded a checkpoint that was there before the probe and had no epoch left to
        train, a training loader yielded no batch, no optimizer was ever built, or the script exited or
        returned before its loop.
        """
    ),
    why=prose(
        """
        Most of what goes wrong in a distributed port shows only while the model trains: replicas drifting
        apart, gradients reduced twice, the sampler repeating its order, BatchNorm statistics, the learning
        rate the ranks really use. A run without a step measures none of it, and a report without findings
        would read as "nothing wrong" when nothing was looked at. This is the probe saying that it could not
        look, so that a clean report never comes from a run that checked nothing (in CI too: the rule is
        high, above the default --fail-on).
        """
    ),
    example=snippet(
        """
        # Bad: an earlier run left ckpt/last.pt at the last epoch, and the script always resumes
        start = torch.load("ckpt/last.pt")["epoch"] + 1 if os.path.exists("ckpt/last.pt") else 0
        for epoch in range(start, args.epochs):  # empty: nothing to train
            train_one_epoch(model, loader, optimizer)

        # Good: an option to start afresh the probe can pass (check train.py -- --no-resume)
        resume = args.resume and os.path.exists("ckpt/last.pt")
        start = torch.load("ckpt/last.pt")["epoch"] + 1 if resume else 0
        for epoch in range(start, args.epochs):
            train_one_epoch(model, loader, optimizer)
        """
    ),
    # the example is the probe's case (a resumed run with nothing left to train): static analysis cannot know
    # what ckpt/last.pt holds; the static half's cases are in fixtures/static/DD904/
    example_context=None,
    fix="Give the script the arguments that make it train (after `--`): the probe needs optimizer steps to measure.",
    fix_variants={
        "resumed": (
            "The script resumed from a checkpoint an earlier run left and had nothing left to train: pass it "
            "more epochs or its option to start afresh (after `--`). The probe never writes to that checkpoint."
        ),
        "empty_loader": (
            "Check the dataset the script loads under the probe (its path, its size): each of the N ranks gets "
            "len(dataset)/N samples, and drop_last with a batch larger than a rank's share yields nothing."
        ),
        "no_optimizer": (
            "Run the probe with the arguments that train (an evaluation or export mode builds no optimizer)."
        ),
        "manual_update": (
            "The probe measures training at torch.optim optimizer steps: an optimizer with the same update "
            "(torch.optim.SGD(params, lr)) lets it; `check --static` still reads this script."
        ),
        "not_analysed": (
            "Run `ddpdoctor check SCRIPT --nproc N` (without --static): the probe measures on the ranks what the "
            "engine does; `--ignore DD904` in a static-only gate that accepts the engine unread."
        ),
        "timeout": (
            "Rerun with a longer --timeout (or fewer --steps, a smaller input through the script's own options): "
            "the run was still starting or computing its first step when the probe stopped it."
        ),
        "no_process": (
            "Nothing of the script ran under the probe: check the script path and its arguments, then read the "
            "launcher's log in the run directory (--keep-run DIR)."
        ),
    },
    run_only="no training step was observed",
)
