"""Tensor-subclass parameters with fsdp_pre/post_all_gather, trained under both engines.

CPU ports of torch's GPU-only ``test_fully_shard_extensions.py`` (2 ranks). Oracle for every
test: *compatibility*. torch's ``fully_shard`` trains an identical copy in the same processes:
at every Adam step the losses, local shards and gradients (every inner tensor) are bitwise
equal, and the hooks are called in the same order with the same arguments (mesh, all-gather
input shapes, ``outer_size`` / ``outer_stride``, module, ``param_dtype``, ``out=`` or not).
The call counts are also checked in *closed form*: 6 parameters (2 here for the uneven MLP),
3 steps, one pre-hook per unshard; the post-hook builds the parameter on the first unshard
and refills it in place (``out=``) on every later one.
"""

from __future__ import annotations

import pytest

from tests._dist import WorkerPool
from tests.extensions._subclass_gather import (
    bf16_gather_release,
    bf16_gather_release_not_bool,
    bf16_gather_uneven,
    two_tensor_meta_mixed_precision,
    two_tensor_train_parity,
)


def _counts(params: int, steps: int, reshard_after_forward: bool) -> dict[str, int]:
    unshards = params * steps * (2 if reshard_after_forward else 1)
    return {"pre": unshards, "post": params, "post_out": unshards - params}


@pytest.mark.parametrize("reshard_after_forward", [True, False])
@pytest.mark.parametrize("version", [1, 2])
def test_two_all_gather_inputs_train_parity(
    world2: WorkerPool, version: int, reshard_after_forward: bool
) -> None:
    """``TwoTensor`` weights (two all-gather inputs each), pre-hook with the one-argument
    (``version`` 1) and the five-argument signature; upstream's
    ``test_all_gather_extensions_train_parity``."""
    counts = world2.run(two_tensor_train_parity, version, reshard_after_forward)
    assert counts == [_counts(6, 3, reshard_after_forward)] * 2


@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_meta_init_with_param_dtype(world2: WorkerPool, reshard_after_forward: bool) -> None:
    """Meta-device ``TwoTensor`` model, ``to_empty``, ``MixedPrecisionPolicy(param_dtype=bf16)``:
    the post-hook gets bf16 and casts into ``out``; upstream's
    ``test_all_gather_extensions_end_to_end``, which only checks that it runs."""
    counts = world2.run(two_tensor_meta_mixed_precision, reshard_after_forward)
    assert counts == [_counts(6, 3, reshard_after_forward)] * 2


@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_uneven_shards_padded_by_pre_hook(world2: WorkerPool, reshard_after_forward: bool) -> None:
    """A bf16 all-gather wrapper subclass on unevenly sharded weights (9 and 3 rows on 2 ranks),
    next to plain biases in the same group: the pre-hook pads from ``outer_size``, the
    post-hook returns the padded gather; upstream's ``test_all_gather_extension_outer_size_stride``
    (which runs one step with ``reshard_after_forward=False`` only)."""
    counts = world2.run(bf16_gather_uneven, reshard_after_forward)
    assert counts == [_counts(2, 3, reshard_after_forward)] * 2


@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_release_outputs_after_post_all_gather(
    world2: WorkerPool, reshard_after_forward: bool
) -> None:
    """torch 2.15's ``fsdp_should_release_all_gather_outputs_after_post_all_gather`` (offered
    on every torch): bitwise with torch, the hooks called as torch calls them, and the
    all-gather outputs freed once the post-hook made its copy."""
    counts = world2.run(bf16_gather_release, reshard_after_forward)
    assert counts == [_counts(2, 3, reshard_after_forward)] * 2


def test_release_hook_must_answer_a_bool(world2: WorkerPool) -> None:
    messages = world2.run(bf16_gather_release_not_bool)
    assert all("must return a bool, got str" in m and "in_proj.weight" in m for m in messages)
