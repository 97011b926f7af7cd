"""The integration tests need the frameworks that ``nox -s integration`` installs (pinned in
``INTEGRATION_REQUIREMENTS`` in noxfile.py). Elsewhere (the ``tests`` session, a bare venv)
pytest collects nothing here but the torchft test, which skips itself there; a venv with
Lightning but without transformers collects everything but the transformers tests.

torchtitan is not among them (0.3.0 needs torch >= 2.14, CI runs 2.13): its test is collected
wherever torchtitan is installed, with or without Lightning, and skips itself on older torch
(``nox -s compat`` installs it; see noxfile.py). The torchft test is always collected and skips
itself, saying so, where torchft is not installed (``nox -s integration`` pins it)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_TORCHTITAN = "world_2/test_torchtitan.py"
_ALWAYS = (_TORCHTITAN, "world_2/test_torchft.py")  # neither needs Lightning

if not importlib.util.find_spec("lightning"):
    here = Path(__file__).parent
    collect_ignore_glob = [
        name
        for name in (p.relative_to(here).as_posix() for p in here.glob("world_*/test_*.py"))
        if name not in _ALWAYS
    ]
elif not importlib.util.find_spec("transformers"):
    collect_ignore_glob = ["world_*/test_transformers.py", "world_*/test_plan_fit_transformers.py"]
else:
    collect_ignore_glob = []
if not importlib.util.find_spec("torchtitan"):
    collect_ignore_glob.append(_TORCHTITAN)
