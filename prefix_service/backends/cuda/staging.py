"""A step's small host-to-device copies as one.

A step moves about a dozen small integer tensors to the GPU (token ids, positions, slots, block
tables, lengths, the cascade's groups). Each copy from pageable memory costs a driver call that
first copies into the driver's own pinned buffer and waits for the stream. `Staging.to_device`
packs them into one pinned host buffer (each 16-byte aligned), queues one asynchronous copy, and
returns device views cut from its destination, shaped and typed as the host tensors were.

A host buffer is reused two steps later, after the event recorded behind its copy has passed
(the step between has read its logits back, so it has long since); it grows when a step needs
more. On a CPU device (the tests) the same packing runs without pinning or events.
"""
from __future__ import annotations

from typing import Sequence

import torch

_ALIGN_WORDS = 4  # each part starts 16 bytes after the last, as a fresh allocation would (Triton's pointer checks)
_DTYPES = (torch.int32, torch.int64)


def _words(t: torch.Tensor) -> int:
    return t.numel() * (2 if t.dtype == torch.int64 else 1)


class Staging:
    def __init__(self, device: torch.device, slots: int = 2) -> None:
        self.device = device
        self.pinned = device.type == "cuda"
        self._buffers: list[torch.Tensor | None] = [None] * slots
        self._events: list[torch.cuda.Event | None] = [None] * slots
        self._turn = 0
        self.copies = 0  # host-to-device copies queued (one a call)

    def _host(self, words: int) -> tuple[int, torch.Tensor]:
        """The next buffer of the ring with room for `words` int32 words, free to overwrite."""
        slot = self._turn
        self._turn = (slot + 1) % len(self._buffers)
        event = self._events[slot]
        if event is not None:
            event.synchronize()  # its last copy has been read by the device
        buf = self._buffers[slot]
        if buf is None or buf.numel() < words:
            buf = torch.empty(max(words, 2 * (buf.numel() if buf is not None else 1024)), dtype=torch.int32,
                              pin_memory=self.pinned)
            self._buffers[slot] = buf
        return slot, buf

    def to_device(self, parts: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Each host tensor of `parts` (int32 or int64, any shape) on the device, by one copy."""
        spans: list[int] = []
        total = 0
        for t in parts:
            if t.dtype not in _DTYPES:
                raise TypeError(f"Staging packs int32 and int64 tensors, not {t.dtype}")
            spans.append(total)
            total += -(-_words(t) // _ALIGN_WORDS) * _ALIGN_WORDS
        slot, buf = self._host(max(total, _ALIGN_WORDS))
        for t, start in zip(parts, spans):
            if t.numel():
                buf[start:start + _words(t)].copy_(t.contiguous().view(-1).view(torch.int32))
        dest = torch.empty(max(total, _ALIGN_WORDS), dtype=torch.int32, device=self.device)
        dest.copy_(buf[:dest.numel()], non_blocking=self.pinned)
        self.copies += 1
        if self.pinned:
            event = torch.cuda.Event()
            event.record()
            self._events[slot] = event
        return [dest[start:start + _words(t)].view(t.dtype).view(t.shape) for t, start in zip(parts, spans)]
