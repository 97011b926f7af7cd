"""An example shardweave plugin: an int8 all-gather for the ``Int8Tensor`` marker subclass.

Importing this module registers nothing: the registry finds ``int8_kind`` (the ``Int8Tensor``
parameter kind, whose only part is ``Int8AllGather``) through the ``shardweave.param_kinds``
entry point in this distribution's ``pyproject.toml``, on the first lookup of
``shardweave.mesh.extension_points.PARAM_KINDS``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shardweave.mesh.extension_points import ParamKind

__all__ = ["Int8AllGather", "Int8Tensor", "int8_kind"]


class Int8Tensor(torch.Tensor):
    """Marks a tensor to be all-gathered in int8 (make one with ``t.as_subclass(Int8Tensor)``)."""


class Int8AllGather:
    """Satisfies ``AllGatherExtension``: sends int8 data plus a per-shard fp32 scale."""

    handled_type: type = Int8Tensor  # subclasses are covered too

    def pre_all_gather(
        self, local: torch.Tensor, mesh: object
    ) -> tuple[tuple[torch.Tensor, ...], object]:
        plain = local.as_subclass(torch.Tensor).float()
        scale = plain.abs().amax().clamp(min=1e-12) / 127.0
        data = torch.round(plain / scale).to(torch.int8)
        # The metadata goes back to post_all_gather unchanged: the (even) shard's shape.
        return (data, scale.reshape(1)), tuple(local.shape)

    def post_all_gather(
        self, outs: Sequence[torch.Tensor], meta: object, dtype: torch.dtype
    ) -> torch.Tensor:
        data, scales = outs  # every rank's data and scale, in rank order
        shape = tuple(meta)  # type: ignore[call-overload]
        rows = data.view(-1, *shape[1:]).to(dtype)
        per_row = scales.to(dtype).repeat_interleave(shape[0])
        return rows * per_row.view(-1, *([1] * (len(shape) - 1)))


def int8_kind() -> ParamKind:
    """The ``Int8Tensor`` kind: sharded as a plain tensor (no handler), gathered in int8."""
    return ParamKind(Int8Tensor, all_gather=Int8AllGather())
