"""The integration tests need the frameworks that ``nox -s integration`` installs (pinned in
``INTEGRATION_REQUIREMENTS`` in noxfile.py). Elsewhere (the ``tests`` session, a bare venv)
pytest collects nothing here, so those runs stay as they are."""

from __future__ import annotations

import importlib.util

collect_ignore_glob = [] if importlib.util.find_spec("lightning") else ["world_*"]
