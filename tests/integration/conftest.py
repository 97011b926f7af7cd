"""The integration tests need the frameworks that ``nox -s integration`` installs (pinned in
``INTEGRATION_REQUIREMENTS`` in noxfile.py). Elsewhere (the ``tests`` session, a bare venv)
pytest collects nothing here, so those runs stay as they are; a venv with Lightning but without
transformers collects everything but the transformers tests."""

from __future__ import annotations

import importlib.util

if not importlib.util.find_spec("lightning"):
    collect_ignore_glob = ["world_*"]
elif not importlib.util.find_spec("transformers"):
    collect_ignore_glob = ["world_*/test_transformers.py"]
else:
    collect_ignore_glob = []
