"""The replicated state on disk (``state.bin``): a pickled skeleton, then every tensor's bytes in one run; and
``Stager``, which stages that state in host memory so that training resumes while the copy is written.

The tensors' bytes go out in 64 MiB writes straight from their (staged, pinned) host memory; a file write
releases the GIL, so a background checkpoint does not hold the training thread up, and nothing is
serialised on the way (torch.save through a file object copies each storage into Python bytes first).
Layout: ``MAGIC``, the header's length (8 bytes, little-endian), the header (pickle: the state with each
tensor replaced by a ``TensorRef``, and each tensor's dtype, shape, offset and size), then the data,
starting at a multiple of 4 KiB. Read back with ``read``; checkpoints older than this format hold
``state.pt`` (torch.save) and ``checkpoint.load`` still reads those.

``Stager`` copies every tensor into a host buffer kept from one checkpoint to the next (pinned where the tensor
is on a GPU, so the copies run as non-blocking transfers with one wait for them all): the training
loop is blocked for about one device-to-host copy of the state, and the staged copy holds exactly the
state of the step it names, whatever the next steps do to the weights. The buffers take as much host
memory as the state, for as long as the Patrol lives. Pinning them takes far longer than a copy into them (12.5 s
against 0.25 s for a 1B model's 12.6 GB on an H200), so ``reserve`` allocates them ahead, on a thread.
"""

from __future__ import annotations

import copy
import ctypes
import pickle
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

import torch

MAGIC = b"TPSTATE1"
NAME = "state.bin"
CHUNK = 64 << 20
ALIGN = 64


class TensorRef(NamedTuple):
    position: int


class _Entry(NamedTuple):
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def _walk(value: Any, replace: Callable[[Any], Any]) -> Any:
    """``value`` rebuilt with ``replace`` applied to every leaf: what is not a dict, list or plain tuple."""
    if isinstance(value, dict):
        return type(value)((k, _walk(v, replace)) for k, v in value.items())
    if isinstance(value, list | tuple) and not hasattr(value, "_fields"):
        items = [_walk(v, replace) for v in value]
        return items if isinstance(value, list) else type(value)(items)
    return replace(value)


def _memory(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous host tensor, without a copy (valid while ``t`` lives)."""
    return memoryview((ctypes.c_ubyte * (t.numel() * t.element_size())).from_address(t.data_ptr())).cast("B")


def write(state: Any, f: BinaryIO) -> None:
    """Write ``state`` (nested dicts, lists and tuples of tensors and picklable values) to ``f``."""
    tensors: list[torch.Tensor] = []

    def strip(leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        tensors.append(leaf.detach())
        return TensorRef(len(tensors) - 1)

    skeleton = _walk(state, strip)
    entries, offset = [], 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        entries.append(_Entry(str(t.dtype).removeprefix("torch."), tuple(t.shape), offset, nbytes))
        offset += -(-nbytes // ALIGN) * ALIGN
    header = pickle.dumps((skeleton, entries), protocol=5)
    start = -(-(len(MAGIC) + 8 + len(header)) // 4096) * 4096
    f.write(MAGIC + struct.pack("<Q", len(header)) + header + bytes(start - len(MAGIC) - 8 - len(header)))
    written = 0
    for t, entry in zip(tensors, entries, strict=True):
        if entry.offset > written:
            f.write(bytes(entry.offset - written))
        host = t.contiguous().cpu() if t.device.type != "cpu" or not t.is_contiguous() else t
        data = _memory(host)
        for i in range(0, len(data), CHUNK):
            f.write(data[i:i + CHUNK])
        written = entry.offset + entry.nbytes


def read(path: Path, map_location: str | torch.device = "cpu") -> Any:
    """The state ``write`` wrote to ``path``, its tensors on ``map_location``."""
    with open(path, "rb", buffering=0) as f:
        if f.read(len(MAGIC)) != MAGIC:
            raise ValueError(f"{str(path)!r} is not a trainpatrol state file")
        (length,) = struct.unpack("<Q", f.read(8))
        skeleton, entries = pickle.loads(f.read(length))
        start = -(-(len(MAGIC) + 8 + length) // 4096) * 4096
        size = max((e.offset + e.nbytes for e in entries), default=0)
        data = torch.empty(size, dtype=torch.uint8)
        view, done = _memory(data), 0
        f.seek(start)
        while done < size:
            n = f.readinto(view[done:done + CHUNK])
            if not n:
                raise ValueError(f"{str(path)!r} is cut short: {done} of {size} bytes of tensor data")
            done += n
    tensors = [data[e.offset:e.offset + e.nbytes].view(getattr(torch, e.dtype)).reshape(e.shape)
               .to(map_location) for e in entries]
    return _walk(skeleton, lambda leaf: tensors[leaf.position] if isinstance(leaf, TensorRef) else leaf)


class Stager:
    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def stage(self, state: Any) -> Any:
        """A copy of ``state`` whose tensors live in this stager's host buffers (reused by the next ``stage``)."""
        streams: set[torch.cuda.Stream] = set()
        staged = self._copy(state, "", streams)
        for stream in streams:  # one wait for every transfer
            stream.synchronize()
        return staged

    def reserve(self, state: Any) -> None:
        """Allocates the buffers ``stage`` will copy ``state`` into, without copying. Not concurrently with
        ``stage``."""
        self._copy(state, "", None)

    def _copy(self, value: Any, name: str, streams: set[torch.cuda.Stream] | None) -> Any:
        if isinstance(value, torch.Tensor):
            return self._tensor(value.detach(), name, streams)
        if isinstance(value, dict):
            return {k: self._copy(v, f"{name}/{k}", streams) for k, v in value.items()}
        if isinstance(value, list | tuple):
            items = [self._copy(v, f"{name}/{i}", streams) for i, v in enumerate(value)]
            return items if isinstance(value, list) else type(value)(items)
        return copy.deepcopy(value)

    def _tensor(self, t: torch.Tensor, name: str, streams: set[torch.cuda.Stream] | None) -> torch.Tensor:
        if t.layout != torch.strided:  # sparse and other layouts: a plain copy
            return t.to("cpu", copy=True) if streams is not None else t
        buf = self._buffers.get(name)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
            self._buffers[name] = buf
        if streams is None:  # reserving
            return buf
        if t.is_cuda:
            buf.copy_(t, non_blocking=True)
            streams.add(torch.cuda.current_stream(t.device))
        else:
            buf.copy_(t)
        return buf
