"""``csan``: a few training steps under torch's CUDA stream sanitizer."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

from ._common import KIT_DIR, PACKAGE_SRCS


def section_csan(device_type: str) -> dict[str, Any]:
    # TORCH_CUDA_SANITIZER must be set before torch is imported: a subprocess of our own.
    env = dict(os.environ, TORCH_CUDA_SANITIZER="1")
    path = [str(KIT_DIR.parent), *PACKAGE_SRCS]
    code = (
        f"import sys; sys.path[:0] = {path!r}\n"
        "import torch\n"
        "from gpu_kit._common import init_world1\n"
        "from gpu_kit._training import apply_engine, make_model, train\n"
        "init_world1('cuda')\n"
        "m = make_model(64, 3, torch.device('cuda'))\n"
        "apply_engine('shardweave', m, 'fsdp', 'cuda')\n"
        "train(m, 'fsdp', torch.device('cuda'), steps=3)\n"
        "torch.cuda.synchronize(); print('csan: no race')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    out = proc.stdout + proc.stderr
    return {"ok": proc.returncode == 0 and "csan: no race" in out, "output_tail": out[-4000:]}
