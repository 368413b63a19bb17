"""Host-to-device copies of expert records for the VRAM tier, on a side CUDA stream.

The copy of the next expert then runs while the GPU computes the previous one. Asynchrony brings two
hazards, each closed by an event:
- a RAM slot must not be refilled by a disk read while a copy out of it is still queued: ``release``
  blocks until the copies of the released keys have run (long done by the end of a layer);
- a VRAM slot must not be overwritten while the compute stream may still read its previous expert:
  ``release`` records the compute stream's position, and the next copy into that slot waits for it on
  the GPU, not on the CPU.
The compute stream waits for each copy on the GPU too, so a materialised expert is safe to use at once.
On a non-CUDA device (the "cpu" stand-in the tests use) a copy is plain and synchronous.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch


class DeviceCopies:
    def __init__(self, device: torch.device):
        self.device = device
        self._cuda = device.type == "cuda"
        self._stream = torch.cuda.Stream(device) if self._cuda else None
        self._copied: dict[Hashable, torch.cuda.Event] = {}  # key -> its copy's completion
        self._slot_free: dict[int, torch.cuda.Event] = {}  # VRAM slot -> compute's last possible use

    def copy(self, key: Hashable, slot: int, target: torch.Tensor, source: torch.Tensor) -> None:
        """Queue source (host, pinned) -> target (VRAM slot ``slot``) for ``key``."""
        if not self._cuda:
            target.copy_(source)
            return
        assert self._stream is not None  # made with a CUDA device
        with torch.cuda.stream(self._stream):
            if (free := self._slot_free.pop(slot, None)) is not None:
                self._stream.wait_event(free)
            target.copy_(source, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._stream)
        torch.cuda.current_stream(self.device).wait_event(done)
        self._copied[key] = done

    def release(self, key: Hashable, slot: int | None) -> None:
        """``key``'s step is over: its host slot may be reused, and its VRAM slot (if any) once the GPU is past now."""
        if not self._cuda:
            return
        if (done := self._copied.pop(key, None)) is not None:
            done.synchronize()
        if slot is not None:
            used = torch.cuda.Event()
            used.record(torch.cuda.current_stream(self.device))
            self._slot_free[slot] = used
