"""Per-dtype tolerances for parity tests (STYLE.md section 7).

A test that needs a looser bound passes ``rtol``/``atol`` to :func:`assert_close` and says why in a
comment next to the call; nothing else in the suite should hard-code a tolerance.
"""

from __future__ import annotations

from typing import Final

import torch

# (rtol, atol). float32/float64 follow torch.testing's defaults; the half types are looser
# because FSDP reduces gradients in a different order than the unsharded oracle, and bf16 keeps
# 8 mantissa bits (fp16 keeps 11).
TOLERANCES: Final[dict[torch.dtype, tuple[float, float]]] = {
    torch.float64: (1e-7, 1e-7),
    torch.float32: (1.3e-6, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-2),
    torch.float16: (1e-3, 1e-3),
}


def tolerances(dtype: torch.dtype) -> tuple[float, float]:
    """Return ``(rtol, atol)`` for ``dtype``; integer and bool dtypes compare exactly."""
    if dtype in TOLERANCES:
        return TOLERANCES[dtype]
    if dtype.is_floating_point or dtype.is_complex:
        raise KeyError(f"tolerances: no entry for {dtype}; add one to tests/_dist/tolerances.py")
    return (0.0, 0.0)


def assert_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    dtype: torch.dtype | None = None,
    msg: str = "",
    *,
    rtol: float | None = None,
    atol: float | None = None,
) -> None:
    """Assert ``actual`` matches ``expected`` within the tolerance of ``dtype``.

    Args:
        actual: the tensor under test (a DTensor is compared through its local tensor only if
            the caller passes ``.to_local()``; this helper does not gather).
        expected: the oracle's tensor; shape, dtype and device must match ``actual``.
        dtype: the dtype whose tolerance applies; defaults to ``actual.dtype``. Pass the compute
            dtype when comparing, say, fp32 gradients reduced from bf16 computation.
        msg: prefixed to the failure message (name the parameter, rank, step).
        rtol: explicit override; explain why at the call site.
        atol: explicit override; explain why at the call site.
    """
    default_rtol, default_atol = tolerances(dtype if dtype is not None else actual.dtype)
    torch.testing.assert_close(
        actual,
        expected,
        rtol=default_rtol if rtol is None else rtol,
        atol=default_atol if atol is None else atol,
        msg=(lambda detail: f"{msg}: {detail}" if msg else detail),
    )
