"""Moved to `ddpdoctor.torchnames` (one neutral module for static analysis, the launch plan and the analyses).

Kept only while the rule modules that import it move to `ddpdoctor/rules/` (issue 10); delete it then.
"""

from __future__ import annotations

from ddpdoctor.torchnames import *  # noqa: F403
from ddpdoctor.torchnames import canonical, env_tags, name_tags  # noqa: F401
