"""Moving a planning node's tensors to host memory and back, on their own CUDA streams.

On a GPU: offloads run on a device-to-host stream into pinned host buffers
that are allocated the first time a node is offloaded and reused every step
after; prefetches run on a host-to-device stream; the compute stream waits on
CUDA events for exactly the copy it needs (no device-wide synchronization);
a freed tensor whose offload may still be running is marked with
`record_stream`, so the allocator does not hand its memory out before the copy
has read it. On the CPU the same calls make plain synchronous copies into
separate host tensors, and waiting is a no-op.

Copies are made per storage (raw bytes), so any tensor geometry (views,
strides, several tensors on one storage) comes back exactly as it was; a
tensor in the arena (planned addresses) is copied as its own bytes, not the
arena's, and comes back into the slot its prefetch was planned at. A
storage that is not on the device (the CPU scalars an attention kernel hands
its backward, its random generator's seed and offset) takes no device memory:
it stays where it is and comes back as itself, on its own device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from executor.capture.planning_graph import span_elements


def _bytes_view(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


@dataclass
class HostCopy:
    """A node's tensors in host memory, and how to rebuild each tensor from them."""

    buffers: list[torch.Tensor]  # one uint8 host buffer per device storage
    slots: list[tuple[int, tuple]]  # per tensor: (buffer index, (size, stride, offset, dtype))
    elsewhere: dict[int, torch.UntypedStorage]  # buffer index -> a storage not on the device, kept as it is

    @property
    def size_bytes(self) -> int:
        return sum(buffer.numel() for buffer in self.buffers)


class Transfers:
    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.host_pool: dict[int, list[torch.Tensor]] = {}
        self.copies: dict[int, HostCopy] = {}
        self.offload_done: dict[int, object] = {}
        self.prefetch_done: dict[int, object] = {}
        # a freed tensor under an unfinished offload: False, the allocator takes its memory back after the copy
        # (its free lands in whichever later allocation finds the copy done); True, the host waits for the copy
        self.wait_before_free = False
        self.arena: torch.Tensor | None = None  # the arena's bytes while a step writes into it (executor.engine.arena)
        # node -> the unfinished offload reading its freed slot of the arena, until what writes there next waits for it
        self.unreclaimed: dict[int, object] = {}
        if self.cuda:
            self.d2h_stream = torch.cuda.Stream(device)
            self.h2d_stream = torch.cuda.Stream(device)

    def _host_buffers(self, key: int, sizes: list[int]) -> list[torch.Tensor]:
        """The node's host buffers: allocated (pinned on a GPU) the first time, reused afterwards."""
        pool = self.host_pool.get(key)
        if pool is None or [b.numel() for b in pool] != sizes:
            pool = [torch.empty(size, dtype=torch.uint8, pin_memory=self.cuda) for size in sizes]
            self.host_pool[key] = pool
        return pool

    def host_pool_bytes(self) -> int:
        return sum(b.numel() for pool in self.host_pool.values() for b in pool)

    def _in_arena(self, tensor: torch.Tensor) -> bool:
        return self.arena is not None and tensor.untyped_storage().data_ptr() == self.arena.data_ptr() \
            and tensor.device == self.arena.device

    def _window(self, tensor: torch.Tensor) -> torch.Tensor:
        """A tensor's own bytes in the arena."""
        start = tensor.data_ptr() - self.arena.data_ptr()
        return self.arena[start:start + span_elements(tensor.shape, tensor.stride()) * tensor.element_size()]

    def offload(self, key: int, tensors: tuple) -> HostCopy:
        storages: list = []  # a storage, or a tensor's window in the arena (uint8)
        index_of: dict[int, int] = {}
        slots = []
        for tensor in tensors:
            if self._in_arena(tensor):
                ptr = tensor.data_ptr()
                if ptr not in index_of:
                    index_of[ptr] = len(storages)
                    storages.append(self._window(tensor))
                slots.append((index_of[ptr], (tuple(tensor.shape), tuple(tensor.stride()), 0, tensor.dtype)))
                continue
            storage = tensor.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in index_of:
                index_of[ptr] = len(storages)
                storages.append(storage)
            slots.append((index_of[ptr], (tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset(), tensor.dtype)))
        elsewhere = {i: storage for i, storage in enumerate(storages) if storage.device.type != self.device.type}
        sizes = [0 if i in elsewhere else s.numel() if isinstance(s, torch.Tensor) else s.nbytes()
                 for i, s in enumerate(storages)]
        buffers = self._host_buffers(key, sizes)
        copied = [(buffer, storage if isinstance(storage, torch.Tensor) else _bytes_view(storage))
                  for i, (buffer, storage) in enumerate(zip(buffers, storages)) if i not in elsewhere]
        if self.cuda:
            ready = torch.cuda.current_stream(self.device).record_event()
            with torch.cuda.stream(self.d2h_stream):
                self.d2h_stream.wait_event(ready)
                unread = self.prefetch_done.pop(key, None)
                if unread is not None:  # a prefetch nobody waited for may still read these host buffers
                    self.d2h_stream.wait_event(unread)
                for buffer, source in copied:
                    buffer.copy_(source, non_blocking=True)
                self.offload_done[key] = self.d2h_stream.record_event()
        else:
            for buffer, source in copied:
                buffer.copy_(source)
        copy = HostCopy(buffers, slots, elsewhere)
        self.copies[key] = copy
        return copy

    def release(self, key: int, tensors: tuple) -> None:
        """Before the device tensors are dropped: memory under an unfinished offload waits for the copy (the
        allocator frees it once the copy is done, at some later allocation; with `wait_before_free`, as a
        memory-measuring pass needs, the host waits for the copy here and the memory goes at once)."""
        if not self.cuda:
            return
        done = self.offload_done.get(key)
        if done is not None and not done.query():
            if self.wait_before_free:
                done.synchronize()
                return
            for tensor in tensors:
                if self._in_arena(tensor):
                    # the arena is never freed: what must wait for the copy is whatever writes this slot next, and
                    # only that (executor.engine.arena.reclaims places the waits; the step's end waits for the rest)
                    self.unreclaimed[key] = done
                elif tensor.device.type == self.device.type:
                    tensor.record_stream(self.d2h_stream)

    def prefetch(self, key: int, offsets_bytes: tuple | None = None) -> tuple:
        """The node's tensors back on the device: into the arena at `offsets_bytes` (one per tensor, each offloaded
        from the arena as its own bytes), else into new allocations."""
        copy = self.copies.get(key)
        if copy is None:
            raise KeyError(key)
        if offsets_bytes is not None:
            return self._prefetch_into_arena(key, copy, offsets_bytes)
        devices = [torch.empty(buffer.numel(), dtype=torch.uint8, device=self.device) for buffer in copy.buffers]
        self._copy_in(key, [pair for i, pair in enumerate(zip(devices, copy.buffers)) if i not in copy.elsewhere])
        rebuilt = []
        for buffer_index, (size, stride, offset, dtype) in copy.slots:
            storage = (copy.elsewhere[buffer_index] if buffer_index in copy.elsewhere
                       else devices[buffer_index].untyped_storage())
            rebuilt.append(torch.empty(0, dtype=dtype, device=storage.device).set_(storage, offset, size, stride))
        return tuple(rebuilt)

    def _prefetch_into_arena(self, key: int, copy: HostCopy, offsets_bytes: tuple) -> tuple:
        windows = {}  # buffer index -> its window in the arena (tensors offloaded as one window come back as one)
        for (buffer_index, _), offset in zip(copy.slots, offsets_bytes):
            windows.setdefault(buffer_index, self.arena[offset:offset + copy.buffers[buffer_index].numel()])
        self._copy_in(key, [(window, copy.buffers[index]) for index, window in windows.items()])
        return tuple(windows[index].view(dtype).as_strided(size, stride)
                     for index, (size, stride, _, dtype) in copy.slots)

    def _copy_in(self, key: int, pairs: list) -> None:
        """Host buffers into device memory (pairs of device, host); on a GPU on the host-to-device stream, after
        what the compute stream queued before (the memory's earlier use) and the node's own offload.

        No record_stream on the device memory: the compute stream waits for this copy (the schedule's wait, or
        `settle` at the end of the step) before anything frees or writes it again, and a record_stream would hold
        each block until every later prefetch queued on this stream had finished."""
        if not self.cuda:
            for device_buffer, host_buffer in pairs:
                device_buffer.copy_(host_buffer)
            return
        allocated = torch.cuda.current_stream(self.device).record_event()
        with torch.cuda.stream(self.h2d_stream):
            self.h2d_stream.wait_event(allocated)
            offloaded = self.offload_done.get(key)
            if offloaded is not None:
                self.h2d_stream.wait_event(offloaded)
            for device_buffer, host_buffer in pairs:
                device_buffer.copy_(host_buffer, non_blocking=True)
            self.prefetch_done[key] = self.h2d_stream.record_event()

    def wait(self, key: int, transfer: str) -> None:
        if not self.cuda:
            return
        event = self.prefetch_done.pop(key, None) if transfer == "prefetch" else self.offload_done.get(key)
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def reclaim(self, keys: tuple, stream: str) -> None:
        """Before writing into arena slots freed under these nodes' offloads: the writing stream ("compute" or
        "h2d") waits for the copies. The compute stream's wait ends the entry (a prefetch there later follows the
        compute stream); the host-to-device stream's leaves it for the compute stream's writer."""
        if not self.cuda:
            return
        for key in keys:
            if stream == "compute":
                event = self.unreclaimed.pop(key, None)
                if event is not None:
                    torch.cuda.current_stream(self.device).wait_event(event)
            else:
                event = self.unreclaimed.get(key)
                if event is not None:
                    self.h2d_stream.wait_event(event)

    def settle(self) -> None:
        """End of a step: the compute stream waits for prefetches nobody waited for, so their buffers can go."""
        self.copies.clear()
        if not self.cuda:
            return
        stream = torch.cuda.current_stream(self.device)
        for event in self.prefetch_done.values():
            stream.wait_event(event)
        self.prefetch_done.clear()
        for event in self.unreclaimed.values():  # slots nothing wrote again this step: the next step may write
            stream.wait_event(event)
        self.unreclaimed.clear()
