"""Conversions between in-process values and the ``stagecast.internal.v1`` wire messages.

Usage::

    msg = tensor_to_proto(t);  t = tensor_from_proto(msg)
    msg = spec_to_proto(spec); spec = spec_from_proto(msg)      # raises ValueError naming the bad field
    msg = step_to_proto(step); step = step_from_proto(msg)
    msg = event_to_proto(event, generation); event = event_from_proto(msg)
"""

from __future__ import annotations

import numpy as np
import torch

from stagecast.grpc_util import MAX_MESSAGE_BYTES
from stagecast.internal.v1 import pipeline_pb2 as pb
from stagecast.microstep import MicroStep, PlanEvent, StreamSpec
from stagecast.names import DTYPES

# What may travel: the model dtypes, plus what latents, indices and frames use.
_DTYPES = {
    **DTYPES,
    "float64": torch.float64,
    "int64": torch.int64,
    "uint8": torch.uint8,
}


# The most bytes a tensor message may stand for: a zero tail is not on the wire, so the shape alone must be bounded.
MAX_TENSOR_BYTES = MAX_MESSAGE_BYTES


def _end_of_data(buf: np.ndarray) -> int:
    """Bytes of ``buf`` (uint8) up to and including its last nonzero one, found from the end in growing blocks (a
    tensor without a zero tail, such as latents, costs one small look)."""
    end, step = buf.size, 4096
    while end > 0:
        start = max(0, end - step)
        block = buf[start:end]
        if block.any():
            return start + int(np.flatnonzero(block)[-1]) + 1
        end, step = start, min(step * 2, 1 << 20)
    return 0


def tensor_to_proto(t: torch.Tensor) -> pb.Tensor:
    """The tensor's bytes on the wire, less any zero tail (``Tensor.zero_tail``): a prompt's embeddings padded with
    zero rows to the text length travel as its tokens."""
    t = t.detach().to("cpu").contiguous()
    name = str(t.dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"tensor dtype {name} cannot travel on the wire")
    # bfloat16 has no numpy dtype: ship its raw 16-bit pattern.
    raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
    buf = raw.numpy().reshape(-1).view(np.uint8)
    end = _end_of_data(buf)
    if end == buf.size:
        return pb.Tensor(shape=list(t.shape), dtype=name, data=buf.tobytes())
    return pb.Tensor(shape=list(t.shape), dtype=name, data=buf[:end].tobytes(), zero_tail=True)


def tensor_from_proto(msg: pb.Tensor) -> torch.Tensor:
    if msg.dtype not in _DTYPES:
        raise ValueError(f"tensor dtype {msg.dtype!r} is not one of {sorted(_DTYPES)}")
    dtype = _DTYPES[msg.dtype]
    shape = tuple(msg.shape)
    if any(n < 0 for n in shape):
        raise ValueError(f"tensor shape {shape} has a negative size")
    itemsize = torch.empty((), dtype=dtype).element_size()
    expected = int(np.prod(shape, dtype=np.int64)) * itemsize if shape else itemsize
    if expected > MAX_TENSOR_BYTES:
        raise ValueError(f"tensor of shape {shape} and dtype {msg.dtype} is {expected} bytes, over {MAX_TENSOR_BYTES}")
    if msg.zero_tail and len(msg.data) <= expected:
        buf = np.zeros(expected, dtype=np.uint8)
        buf[: len(msg.data)] = np.frombuffer(msg.data, dtype=np.uint8)
    elif len(msg.data) == expected:
        buf = np.frombuffer(msg.data, dtype=np.uint8).copy()
    else:
        at_most = "at most " if msg.zero_tail else ""
        raise ValueError(
            f"tensor of shape {shape} and dtype {msg.dtype} needs {at_most}{expected} bytes, got {len(msg.data)}"
        )
    if dtype == torch.bfloat16:
        return torch.from_numpy(buf.view(np.int16)).view(torch.bfloat16).reshape(shape)
    np_dtype = torch.empty((), dtype=dtype).numpy().dtype
    return torch.from_numpy(buf.view(np_dtype)).reshape(shape)


def spec_to_proto(spec: StreamSpec) -> pb.StreamSpec:
    return pb.StreamSpec(
        stream_id=spec.stream_id,
        latent_channels=spec.latent_channels,
        chunk_frames=spec.chunk_frames,
        latent_height=spec.latent_height,
        latent_width=spec.latent_width,
        timesteps=list(spec.timesteps),
        shift=spec.shift,
        seed=spec.seed,
        policy=spec.policy,
        window=spec.window or 0,
        sink=spec.sink,
        reset_frames=spec.reset_frames or 0,
        sampler=spec.sampler,
        num_chunks=spec.num_chunks or 0,
        text_len=spec.text_len,
        input_latents=spec.input_latents,
        image_latents=spec.image_latents,
        guidance_scale=spec.guidance_scale,
        warmup=spec.warmup,
    )


def spec_from_proto(msg: pb.StreamSpec) -> StreamSpec:
    return StreamSpec(
        stream_id=msg.stream_id,
        latent_channels=msg.latent_channels,
        chunk_frames=msg.chunk_frames,
        latent_height=msg.latent_height,
        latent_width=msg.latent_width,
        # float32 on the wire: round-trip through it so both ends see the same ladder.
        timesteps=tuple(float(t) for t in msg.timesteps),
        shift=float(msg.shift) if msg.shift else 1.0,
        seed=msg.seed,
        policy=msg.policy or "per_level",
        window=msg.window or None,
        sink=msg.sink,
        reset_frames=msg.reset_frames or None,
        sampler=msg.sampler or "x0",
        num_chunks=msg.num_chunks or None,
        text_len=msg.text_len or 512,
        input_latents=msg.input_latents,
        image_latents=msg.image_latents,
        guidance_scale=float(msg.guidance_scale) if msg.guidance_scale else 1.0,
        warmup=msg.warmup,
    )


def step_to_proto(step: MicroStep) -> pb.MicroStep:
    return pb.MicroStep(stream=step.stream, chunk=step.chunk, level=step.level)


def step_from_proto(msg: pb.MicroStep) -> MicroStep:
    return MicroStep(stream=msg.stream, chunk=msg.chunk, level=msg.level)


def event_to_proto(event: PlanEvent, generation: int) -> pb.PlanEvent:
    """The one wire form of a plan event (texts included where the event has them)."""
    msg = pb.PlanEvent(generation=generation, seq=event.seq, traceparent=event.traceparent)
    if event.kind == "open":
        assert event.spec is not None
        msg.open.spec.CopyFrom(spec_to_proto(event.spec))
        if event.text is not None:
            msg.open.text.CopyFrom(tensor_to_proto(event.text))
        if event.latents is not None:
            msg.open.image.CopyFrom(tensor_to_proto(event.latents))
        if event.negative_text is not None:
            msg.open.negative_text.CopyFrom(tensor_to_proto(event.negative_text))
    elif event.kind == "batch":
        msg.batch.steps.extend(step_to_proto(s) for s in event.steps)
    elif event.kind == "close":
        msg.close.stream_id = event.stream_id or 0
    elif event.kind == "input":
        msg.input.stream_id = event.stream_id or 0
        msg.input.chunk = event.chunk
        if event.latents is not None:
            msg.input.latents.CopyFrom(tensor_to_proto(event.latents))
    elif event.kind == "steps":
        msg.steps.stream_id = event.stream_id or 0
        msg.steps.from_chunk = event.from_chunk
        msg.steps.timesteps.extend(event.timesteps)
    else:
        msg.prompt.stream_id = event.stream_id or 0
        msg.prompt.from_chunk = event.from_chunk
        if event.text is not None:
            msg.prompt.text.CopyFrom(tensor_to_proto(event.text))
        msg.prompt.recache = event.recache
        for chunk, latents in event.window:
            item = msg.prompt.window.add(chunk=chunk)
            if latents is not None:
                item.latents.CopyFrom(tensor_to_proto(latents))
    return msg


def event_from_proto(msg: pb.PlanEvent) -> PlanEvent:
    """Inverse of ``event_to_proto``; raises ValueError for an event that carries nothing or a bad field."""
    kind = msg.WhichOneof("event")
    common = dict(seq=msg.seq, traceparent=msg.traceparent)
    if kind == "open":
        text = tensor_from_proto(msg.open.text) if msg.open.HasField("text") else None
        image = tensor_from_proto(msg.open.image) if msg.open.HasField("image") else None
        negative = tensor_from_proto(msg.open.negative_text) if msg.open.HasField("negative_text") else None
        spec = spec_from_proto(msg.open.spec)
        return PlanEvent("open", spec=spec, text=text, latents=image, negative_text=negative, **common)
    if kind == "batch":
        return PlanEvent("batch", steps=tuple(step_from_proto(s) for s in msg.batch.steps), **common)
    if kind == "close":
        return PlanEvent("close", stream_id=msg.close.stream_id, **common)
    if kind == "prompt":
        text = tensor_from_proto(msg.prompt.text) if msg.prompt.HasField("text") else None
        window = tuple(
            (w.chunk, tensor_from_proto(w.latents) if w.HasField("latents") else None) for w in msg.prompt.window
        )
        return PlanEvent(
            "prompt",
            stream_id=msg.prompt.stream_id,
            from_chunk=msg.prompt.from_chunk,
            text=text,
            recache=msg.prompt.recache,
            window=window,
            **common,
        )
    if kind == "input":
        latents = tensor_from_proto(msg.input.latents) if msg.input.HasField("latents") else None
        return PlanEvent("input", stream_id=msg.input.stream_id, chunk=msg.input.chunk, latents=latents, **common)
    if kind == "steps":
        if msg.steps.from_chunk < 0:
            raise ValueError(f"steps.from_chunk must be >= 0, got {msg.steps.from_chunk}")
        return PlanEvent(
            "steps",
            stream_id=msg.steps.stream_id,
            from_chunk=msg.steps.from_chunk,
            timesteps=tuple(msg.steps.timesteps),
            **common,
        )
    raise ValueError("plan event carries no event")
