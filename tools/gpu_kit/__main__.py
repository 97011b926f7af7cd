"""``python tools/gpu_kit``: the kit's command line (``driver.main``); also how the kit starts
each section, bench round and mutant rank in a process of its own."""

from __future__ import annotations

import sys
from pathlib import Path

_KIT_DIR = Path(__file__).resolve().parent
# Run as a folder, python puts the folder itself first on sys.path (even with -I), which
# would make each section module importable a second time under a top-level name ("bench",
# "sync"). The package is imported from its parent folder instead, as ``gpu_kit``.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _KIT_DIR]
if str(_KIT_DIR.parent) not in sys.path:
    sys.path.insert(0, str(_KIT_DIR.parent))

from gpu_kit.driver import main  # noqa: E402 (needs the path above)

if __name__ == "__main__":
    sys.exit(main())
