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
strides, several tensors on one storage) comes back exactly as it was. A
storage that is not on the device (the CPU scalars an attention kernel hands
its backward, its random generator's seed and offset) takes no device memory:
it stays where it is and comes back as itself, on its own device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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

    def offload(self, key: int, tensors: tuple) -> HostCopy:
        storages: list[torch.UntypedStorage] = []
        index_of: dict[int, int] = {}
        slots = []
        for tensor in tensors:
            storage = tensor.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in index_of:
                index_of[ptr] = len(storages)
                storages.append(storage)
            slots.append((index_of[ptr], (tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset(), tensor.dtype)))
        elsewhere = {i: storage for i, storage in enumerate(storages) if storage.device.type != self.device.type}
        buffers = self._host_buffers(key, [0 if i in elsewhere else s.nbytes() for i, s in enumerate(storages)])
        copied = [pair for i, pair in enumerate(zip(buffers, storages)) if i not in elsewhere]
        if self.cuda:
            ready = torch.cuda.current_stream(self.device).record_event()
            with torch.cuda.stream(self.d2h_stream):
                self.d2h_stream.wait_event(ready)
                unread = self.prefetch_done.pop(key, None)
                if unread is not None:  # a prefetch nobody waited for may still read these host buffers
                    self.d2h_stream.wait_event(unread)
                for buffer, storage in copied:
                    buffer.copy_(_bytes_view(storage), non_blocking=True)
                self.offload_done[key] = self.d2h_stream.record_event()
        else:
            for buffer, storage in copied:
                buffer.copy_(_bytes_view(storage))
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
                if tensor.device.type == self.device.type:
                    tensor.record_stream(self.d2h_stream)

    def prefetch(self, key: int) -> tuple:
        copy = self.copies.get(key)
        if copy is None:
            raise KeyError(key)
        devices = [torch.empty(buffer.numel(), dtype=torch.uint8, device=self.device) for buffer in copy.buffers]
        copied = [pair for i, pair in enumerate(zip(devices, copy.buffers)) if i not in copy.elsewhere]
        if self.cuda:
            allocated = torch.cuda.current_stream(self.device).record_event()
            with torch.cuda.stream(self.h2d_stream):
                self.h2d_stream.wait_event(allocated)
                offloaded = self.offload_done.get(key)
                if offloaded is not None:
                    self.h2d_stream.wait_event(offloaded)
                # No record_stream on the device buffers: the compute stream waits for this copy (the schedule's
                # wait, or `settle` at the end of the step) before anything frees them, and a record_stream would
                # hold each block until every later prefetch queued on this stream had finished.
                for device_buffer, host_buffer in copied:
                    device_buffer.copy_(host_buffer, non_blocking=True)
                self.prefetch_done[key] = self.h2d_stream.record_event()
        else:
            for device_buffer, host_buffer in copied:
                device_buffer.copy_(host_buffer)
        rebuilt = []
        for buffer_index, (size, stride, offset, dtype) in copy.slots:
            storage = (copy.elsewhere[buffer_index] if buffer_index in copy.elsewhere
                       else devices[buffer_index].untyped_storage())
            rebuilt.append(torch.empty(0, dtype=dtype, device=storage.device).set_(storage, offset, size, stride))
        return tuple(rebuilt)

    def wait(self, key: int, transfer: str) -> None:
        if not self.cuda:
            return
        event = self.prefetch_done.pop(key, None) if transfer == "prefetch" else self.offload_done.get(key)
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def settle(self) -> None:
        """End of a step: the compute stream waits for prefetches nobody waited for, so their buffers can go."""
        self.copies.clear()
        if not self.cuda:
            return
        stream = torch.cuda.current_stream(self.device)
        for event in self.prefetch_done.values():
            stream.wait_event(event)
        self.prefetch_done.clear()
