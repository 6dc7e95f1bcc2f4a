"""Copies between the host and a stage's GPU that never make the host wait for the GPU.

A blocking copy between pageable host memory and a CUDA device (``tensor.to(device)``, ``tensor.to("cpu")``) is a
copy and a stream synchronize (PyTorch's ``memcpy_and_sync``): the host waits until every kernel already queued on
the stream has run.  In a stage that queue is the previous forward: a forward whose first act is to copy its chunks'
noise (generated on the CPU, ``stage_service.sampler.chunk_noise``) and its timesteps to the GPU waited for the
previous forward to finish, and only then launched its own embedding, conditioning, RoPE tables and graph input
copies, with the GPU idle meanwhile.  Its CUDA-event span held that idle time: the forwards' spans summed to 48.9% of
an H100's time where NVML saw it busy 42.8% (r30, six 1.3B streams).

``to_device`` stages a host tensor in pinned memory and copies it asynchronously on the current stream, ordered
before the kernels that read it (the caching host allocator keeps the pinned block until the copy has run).
``to_host`` starts a device tensor's copy into pinned memory on the current stream, right behind the kernels that
made it, and gives back the host tensor with the event that says it is there (``HostTensor.wait``): the thread that
ships the tensor waits for it, the one that launches the next forward does not, and the copy is not queued behind
the forwards launched after it.  Either copies the same bytes: results are bit for bit those of ``.to``.

On a CPU both are plain ``.to``::

    x = to_device(chunk_noise(spec, chunk, 0), dit_slice.device)     # the host goes on launching
    out = to_host(latents)                                            # HostTensor
    out.wait().numpy()                                                # on the thread that sends it
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor.to(device)``; from the host to a CUDA device, without waiting for the work queued on it."""
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


@dataclass(frozen=True)
class HostTensor:
    """A tensor on its way to the host: ``tensor`` holds its values once ``ready`` (a CUDA event; None: already)."""

    tensor: torch.Tensor
    ready: torch.cuda.Event | None = None

    def wait(self) -> torch.Tensor:
        if self.ready is not None:
            self.ready.synchronize()
        return self.tensor


def to_host(tensor: torch.Tensor) -> HostTensor:
    """The tensor's copy on the host, started now on the current stream (waited for by ``HostTensor.wait``)."""
    if tensor.device.type != "cuda":
        return HostTensor(tensor.to("cpu"))
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record(torch.cuda.current_stream(tensor.device))
    return HostTensor(host, ready)
