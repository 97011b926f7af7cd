"""Streaming safetensors files to and from a ``fully_shard``-ed model, with no dependency.

Design note: the safetensors format
    As specified at https://github.com/huggingface/safetensors (README, "Format"): 8 bytes,
    the header's length N as an unsigned little-endian 64-bit integer; N bytes of UTF-8 JSON
    (starting with ``{``, padded with spaces; we pad N to a multiple of 8 as the reference
    writer does, so the data starts aligned) mapping each tensor name to ``{"dtype": "F32",
    "shape": [...], "data_offsets": [begin, end]}`` plus an optional ``"__metadata__"``
    string-to-string map; then the data: each tensor's C-contiguous little-endian bytes at
    ``[begin, end)`` counted from the end of the header, the ranges back to back with no gaps.
    Because names, dtypes and global shapes are all known from the sharded model, the whole
    header is written before any tensor is gathered, and each tensor goes to its offset as
    soon as it is gathered (see Design note: one tensor at a time).

Design note: tied weights in safetensors files
    ``state_dict()`` lists a tied parameter under each of its names; we write every name with
    its own byte range (the tensor is gathered once and its bytes written twice), so
    ``safetensors.torch.load_file`` returns exactly the ``state_dict()`` keys. The reference
    writer's ``save_file`` refuses tensors that share memory and its ``save_model`` keeps one
    name per tie; ``load_safetensors`` accepts such a file, since any one name of a tied
    parameter loads it.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import mmap
import os
import sys
from typing import IO, Final

import torch
import torch.distributed as dist
from torch import nn

from shardweave.fsdp.checkpoint._full_state_dict import (
    GatherBuffers,
    IncompatibleKeys,
    LoadSource,
    TensorMeta,
    gather_full_tensor,
    load_full_tensors,
    state_dict_targets,
)

__all__ = ["load_safetensors", "save_safetensors"]

_DTYPE_CODES: Final[dict[torch.dtype, str]] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint64: "U64",
    torch.uint32: "U32",
    torch.uint16: "U16",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.complex64: "C64",
}
_CODE_DTYPES: Final[dict[str, torch.dtype]] = {v: k for k, v in _DTYPE_CODES.items()}
_MAX_HEADER_BYTES: Final = 100 * 1024 * 1024  # the reference reader's limit


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _check_byte_order(api: str) -> None:
    if sys.byteorder != "little":
        raise NotImplementedError(
            f"{api}: safetensors files are little-endian and this host is {sys.byteorder}-endian; "
            "byte swapping is not implemented"
        )


def _header(
    entries: list[tuple[str, torch.Tensor]], metadata: dict[str, str] | None
) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """The padded JSON header and each entry's ``[begin, end)`` in the data section."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offsets: dict[str, tuple[int, int]] = {}
    pos = 0
    for name, t in entries:
        end = pos + t.numel() * t.element_size()  # global numel for a DTensor
        offsets[name] = (pos, end)
        header[name] = {
            "dtype": _DTYPE_CODES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [pos, end],
        }
        pos = end
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return raw, offsets


def _write_bytes(f: IO[bytes], t: torch.Tensor) -> None:
    nbytes = t.numel() * t.element_size()
    if nbytes:
        # The tensor's memory as a buffer, without numpy (an optional dependency of torch).
        f.write(memoryview((ctypes.c_char * nbytes).from_address(t.data_ptr())))


def save_safetensors(
    model: nn.Module, path: str | os.PathLike[str], *, metadata: dict[str, str] | None = None
) -> None:
    """Write a sharded model's full state dict to one safetensors file, streaming.

    The header (names, dtypes, global shapes, offsets) comes from the sharded parameters'
    metadata and is written first; then each tensor is gathered, written at its offset by rank
    0 and dropped, so no rank holds more than one full tensor (see Design note: one tensor at a
    time). Rank 0 writes ``path`` (through a temporary file renamed at the end); every rank must
    call this. The format is written here, so saving needs no dependency (see Design note: the
    safetensors format); tied parameters are written under each name (see Design note: tied
    weights in safetensors files).

    Args:
        model: the sharded model; every ``state_dict()`` entry must be a tensor.
        path: the file rank 0 writes.
        metadata: the header's optional ``"__metadata__"`` (string values; e.g.
            ``{"format": "pt"}``, which ``transformers`` looks for).

    Raises:
        ValueError: on every rank, before any gather, for an entry that is not a tensor or has
            a dtype safetensors cannot store.
        OSError: on every rank, when rank 0 could not write the file.

    Example::

        save_safetensors(model, "model.safetensors", metadata={"format": "pt"})
    """
    api = "save_safetensors"
    _check_byte_order(api)
    rank, world = _rank_world()
    entries = _tensor_entries(api, model, metadata)
    header, offsets = _header(entries, metadata)
    data_start = 8 + len(header)
    tmp = f"{os.fspath(path)}.tmp-{os.getpid()}"
    f: IO[bytes] | None = None
    error: str | None = None
    if rank == 0:
        try:
            f = open(tmp, "wb")  # noqa: SIM115 -- closed below, after the collectives
            f.write(len(header).to_bytes(8, "little"))
            f.write(header)
        except OSError as exc:
            error = f"{api}: rank 0 could not write {os.fspath(path)!r}: {exc}"
    _agree(error, world)
    write = None if f is None or error is not None else f
    try:
        _gather_and_write(entries, write, {k: data_start + v[0] for k, v in offsets.items()})
    except OSError as exc:
        error = f"{api}: rank 0 could not write {os.fspath(path)!r}: {exc}"
    if f is not None:
        try:
            f.close()
            if error is None:
                os.replace(tmp, path)
            else:
                os.remove(tmp)
        except OSError as exc:
            error = error or f"{api}: rank 0 could not write {os.fspath(path)!r}: {exc}"
    _agree(error, world)


def _tensor_entries(
    api: str, model: nn.Module, metadata: dict[str, str] | None
) -> list[tuple[str, torch.Tensor]]:
    """The model's state-dict entries, once each is known to be a tensor safetensors can
    store and ``metadata`` to map strings to strings (else ValueError, on every rank)."""
    entries: list[tuple[str, torch.Tensor]] = []
    for name, t in state_dict_targets(model).items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{api}: {name!r} is {type(t).__name__}, not a tensor")
        if t.dtype not in _DTYPE_CODES:
            raise ValueError(f"{api}: {name!r} has dtype {t.dtype}, which safetensors cannot hold")
        entries.append((name, t))
    if metadata is not None and not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise ValueError(f"{api}: metadata must map str to str, got {metadata!r}")
    return entries


def _gather_and_write(
    entries: list[tuple[str, torch.Tensor]], f: IO[bytes] | None, starts: dict[str, int]
) -> None:
    """Gather each distinct tensor of ``entries`` in turn (a collective: every rank) and, where
    ``f`` is given (rank 0, no error yet), write it at the file offset of each of its names.

    A write error on rank 0 does not stop it gathering, so no rank is left in a collective:
    the first one is raised once every tensor is gathered."""
    names_of: dict[int, list[str]] = {}
    for name, t in entries:
        names_of.setdefault(id(t), []).append(name)
    done: set[int] = set()
    failed: OSError | None = None
    buffers = GatherBuffers(t for _, t in entries)
    for _, t in entries:
        if id(t) in done:
            continue
        done.add(id(t))
        full = gather_full_tensor(t, buffers)
        if f is not None and failed is None:
            try:
                data = full.to("cpu").contiguous()
                for alias in names_of[id(t)]:
                    f.seek(starts[alias])
                    _write_bytes(f, data)
                del data
            except OSError as exc:
                failed = exc
        del full  # see Design note: one tensor at a time
    if failed is not None:
        raise failed


def _agree(error: str | None, world: int) -> None:
    """Raise rank 0's error on every rank (a broadcast, so also a barrier)."""
    if world > 1:
        box: list[object] = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]  # type: ignore[assignment]
    if error is not None:
        raise OSError(error)


def _read_header(api: str, f: IO[bytes], size: int) -> tuple[int, dict[str, object]]:
    prefix = f.read(8)
    if len(prefix) != 8:
        raise ValueError(f"{api}: the file is too short for a safetensors header")
    n = int.from_bytes(prefix, "little")
    if n > _MAX_HEADER_BYTES or 8 + n > size:
        raise ValueError(f"{api}: header length {n} does not fit the file ({size} bytes)")
    header = json.loads(f.read(n).decode())
    if not isinstance(header, dict):
        raise ValueError(f"{api}: the header is not a JSON object")
    return 8 + n, header


def _mapped_source(
    api: str, mapped: mmap.mmap, header: dict[str, object], data_start: int, size: int
) -> LoadSource:
    """The file's entries as a ``LoadSource``: each full tensor viewed in ``mapped`` (the
    file's mapping, ``size`` bytes, data from ``data_start``) when fetched, without reading it."""
    meta: dict[str, TensorMeta] = {}
    spans: dict[str, tuple[int, int]] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict) or info.get("dtype") not in _CODE_DTYPES:
            raise ValueError(f"{api}: entry {name!r} has an unknown dtype: {info!r}")
        begin, end = info["data_offsets"]
        if not 0 <= begin <= end <= size - data_start:
            raise ValueError(f"{api}: entry {name!r} lies outside the file: {info!r}")
        meta[name] = TensorMeta(_CODE_DTYPES[info["dtype"]], tuple(info["shape"]))
        spans[name] = (data_start + begin, data_start + end)

    def fetch(name: str) -> torch.Tensor:
        dtype, shape = meta[name]
        begin, end = spans[name]
        if begin == end:
            return torch.empty(shape, dtype=dtype)
        raw = torch.frombuffer(mapped, dtype=torch.uint8, count=end - begin, offset=begin)
        if raw.data_ptr() % raw.new_empty(0, dtype=dtype).element_size():
            raw = raw.clone()  # offsets need not be aligned to the element size
        return raw.view(dtype).view(shape)

    return LoadSource(meta, fetch)


def load_safetensors(
    model: nn.Module, path: str | os.PathLike[str], *, strict: bool = True
) -> IncompatibleKeys:
    """Load a safetensors file into a sharded model, each rank reading only its own slices.

    Every rank memory-maps ``path`` (it must be readable on every rank, e.g. a shared file
    system), views each full tensor in the mapping without reading it, and copies its own piece
    into the live local shard in place; for dim-0 shards only that piece's pages are read. No
    communication moves tensor data; ranks exchange only their verdict on the keys (see Design
    note: ranks agree before they communicate). Any file in the format loads: ours, or one
    from ``safetensors.torch.save_file`` / ``save_model`` (a tied parameter needs only one of
    its names; see Design note: tied weights in safetensors files). The ``safetensors``
    package is not needed.

    Args:
        model: the sharded model to load into (in place).
        path: the safetensors file.
        strict: raise when the file lacks an entry of the model or has one the model lacks.

    Returns:
        ``IncompatibleKeys(missing_keys, unexpected_keys)``.

    Raises:
        RuntimeError: on every rank, for missing/unexpected keys, mis-shaped entries, or a file
            some rank could not read (naming the rank).

    Example::

        load_safetensors(model, "model.safetensors")
    """
    api = "load_safetensors"
    _check_byte_order(api)
    rank, world = _rank_world()
    fd = None
    mm: mmap.mmap | None = None
    source: LoadSource | None = None
    error: str | None = None
    try:
        fd = open(path, "rb")  # noqa: SIM115 -- the mapping outlives this block
        size = os.fstat(fd.fileno()).st_size
        data_start, header = _read_header(api, fd, size)
        # ACCESS_COPY: a private, writable mapping (torch.frombuffer wants writable memory);
        # pages are read only when touched, and nothing is ever written back.
        mm = mmap.mmap(fd.fileno(), 0, access=mmap.ACCESS_COPY)
        source = _mapped_source(api, mm, header, data_start, size)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        error = f"{api}: rank {rank} could not read {os.fspath(path)!r}: {exc}"
    try:
        if world > 1:
            errors: list[object] = [None] * world
            dist.all_gather_object(errors, error)
            error = next((e for e in errors if isinstance(e, str)), None)
        if error is not None:
            raise RuntimeError(error)
        return load_full_tensors(
            api, model, source, strict=strict, from_rank0=False, tied_aliases_optional=True
        )
    finally:
        source = None
        if mm is not None:
            # BufferError: a tensor view still exists; the mapping closes when it is collected.
            with contextlib.suppress(BufferError):
                mm.close()
        if fd is not None:
            fd.close()
