"""DD503 non-strict-load: the rule's catalog entry, its documentation and its parameters.

How it is found lives beside this file: static.py (from the source) and probe.py (from a recorded run),
where the rule has that half.
"""

from __future__ import annotations

from ddpdoctor.levels import Severity
from ddpdoctor.rules.rule import Rule, prose, snippet

CODE = "DD503"

RULE = Rule(
    package=__name__,
    code=CODE,
    name="non-strict-load",
    severity=Severity.MEDIUM,
    summary="load_state_dict(strict=False) where keys mismatch (silently skipped weights)",
    what=prose(
        """
        Static analysis looks for `load_state_dict(..., strict=False)` whose result (the missing and
        unexpected keys) is not inspected.

        The probe records the keys `load_state_dict` reported as missing or unexpected, and fires when any
        parameter or buffer of the model was not loaded, with how many.
        """
    ),
    why=prose(
        """
        With `strict=False`, `load_state_dict` skips every key that does not match and returns the mismatches
        instead of raising. With a "module." prefix mismatch (DD501) no key matches, nothing is loaded, and
        the model trains or evaluates from its random initialisation; with a partial mismatch some layers stay
        random. The returned (missing_keys, unexpected_keys) tuple is almost always ignored.
        """
    ),
    example=snippet(
        """
        # Bad: nothing matches ("module." prefix) and nothing complains
        model.load_state_dict(torch.load("ckpt.pt"), strict=False)

        # Good: fix the key names, then load strictly
        from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

        state = torch.load("ckpt.pt", map_location="cpu")
        consume_prefix_in_state_dict_if_present(state, "module.")
        model.load_state_dict(state)  # strict=True: a mismatch raises
        """
    ),
    fix=(
        "Load with strict=True after fixing the key names; if partial loading is intended, check the "
        "missing_keys and unexpected_keys that load_state_dict returns."
    ),
    cost_note=prose(
        """
        medium by default because a static finding cannot tell how much fails to load; the cost is what did not
        load: everything with a "module." prefix (the benchmark's row, a random network), one layer when a head
        was renamed. The probe's finding is critical when nothing loaded.
        """
    ),
)
