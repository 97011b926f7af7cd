"""Weights tied *after* fully_shard (issue 29): the bodies the world_2 and world_4 tests share.

transformers builds a tied model untied, shards it, loads it, then ties ``lm_head.weight =
embed_tokens.weight``: the head's module then holds the embedding group's sharded parameter
while another group (the root, or the head's own) still manages the head. Oracles: *reference*
(the same model tied from the start, unsharded, every rank's batch) and *compatibility*
(torch's fully_shard with the same calls, bitwise) where torch trains it right, which is with
an even shard of the tied weight. With an uneven one (padded shards) torch 2.13 copies the
shared shard into each group's own padded buffer and one group trains on a stale copy after
the first step: shardweave is checked against the reference there, and each body reports
whether torch's engine also matched it.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from shardweave.fsdp import fully_shard
from tests.fsdp._models import TinyGPT, loss_fn, make_batch
from tests.fsdp._oracle import assert_matches_reference, assert_same_as_torch

# Where the head sits when the tie is made (the embedding is always in a group of its own):
LAYOUTS = {
    # transformers' plan: blocks, [embedding, final norm] kept gathered, the head in the root
    "root_keeps_head": "head in the root; [tok, norm] with reshard_after_forward=False",
    "root_reshards_head": "head in the root; tok alone, resharded after forward",
    "head_own_group": "head in a group of its own, tok in another",
    "one_group_untied": "tok and head in one group, tied only afterwards",
}


def untied_gpt(vocab: int) -> tuple[TinyGPT, TinyGPT]:
    """(built untied as transformers builds it, the tied reference) with equal values."""
    torch.manual_seed(0)
    tied = TinyGPT(vocab=vocab)
    model = copy.deepcopy(tied)
    model.head.weight = nn.Parameter(model.tok.weight.detach().clone())
    return model, tied


def shard_then_tie(model: TinyGPT, api: Any, layout: str, **kwargs: Any) -> None:
    for layer in model.layers:
        api(layer, **kwargs)
    if layout == "root_keeps_head":
        api([model.tok, model.norm], reshard_after_forward=False, **kwargs)
    elif layout == "root_reshards_head":
        api(model.tok, **kwargs)
    elif layout == "head_own_group":
        api(model.tok, **kwargs)
        api(model.head, **kwargs)
    else:
        api([model.tok, model.head], **kwargs)
    api(model, **kwargs)
    model.head.weight = model.tok.weight  # the tie, after sharding


def tied_after_shard(rank: int, world: int, layout: str, vocab: int) -> bool:
    """Train 3 SGD steps; returns whether torch's engine matched the reference throughout."""
    model, ref = untied_gpt(vocab)
    tmodel = copy.deepcopy(model)
    shard_then_tie(model, fully_shard, layout)
    shard_then_tie(tmodel, torch_fully_shard, layout)
    assert model.head.weight is model.tok.weight
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref.named_parameters()]
    even = vocab % world == 0
    # SGD: Adam would turn last-bit differences of near-zero gradients into visible steps.
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, tmodel, ref)]
    torch_right = True
    for step in range(3):
        batches = [make_batch("gpt", 1000 * step + r) for r in range(world)]
        for b in batches:
            b.remainder_(vocab)
        for m in (model, tmodel):
            loss_fn("gpt", m(batches[rank]), batches[rank]).backward()
        (sum(loss_fn("gpt", ref(b), b) for b in batches) / world).backward()  # type: ignore[union-attr]
        # Both uses' gradients land in the one shard: the reference sums them in autograd,
        # the groups each reduce their own, so the sums may differ in the last bits.
        if even:
            assert_same_as_torch(model, tmodel, f"{layout} step {step}")
        assert_matches_reference(model, ref, "grad", rank, world, f"{layout} step {step}")
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
        assert_matches_reference(model, ref, "param", rank, world, f"{layout} step {step}")
        try:
            assert_matches_reference(tmodel, ref, "param", rank, world)
        except AssertionError:
            torch_right = False
        assert model.head.weight is model.tok.weight, f"{layout} step {step}: untied"
    return torch_right
