"""Execute batches of micro-steps on one DiT slice, holding each stream's per-slice state.

Usage (the same object serves the single-process reference and a stage process)::

    runner = SliceRunner(dit_slice)                  # graphs=GraphedBlocks(dit_slice): blocks as CUDA graphs
    runner.open_stream(spec, text_embeds)            # text K/V cached per stream and prompt
    x = runner.forward(steps, inputs)                # first slice: inputs=None (latents come from the store)
    results = runner.finish(steps, x)                # last slice: sampler step, next latents, finished chunks
    runner.close_stream(spec.stream_id)              # frees KV, text K/V and latents

A stream's latents live in a small per-runner store keyed by (stream, chunk): the last slice puts the
next level's latent there after its sampler step, and the first slice takes its input from there.  When
one process runs both ends the store is shared; a stage process fills the first slice's store from the
last stage over the data plane (``put_latent``).  Values are popped when used, so the store holds at most
one latent per chunk in flight.

Classifier-free guidance (``spec.guidance_scale > 1``): every micro-step of a guided stream runs two rows, the
conditional branch (0: the prompt) and the unconditional one (1: the negative prompt), and each branch keeps its
own KV rows.  The K/V a chunk writes depend on the text it was conditioned on, so sharing one branch's KV with
the other would change what the other computes; no policy shares it.  Sequential CFG (``cfg_size=1``) runs both
rows in one forward, one after the other in the batch; CFG-parallel (``cfg_size=2``) runs branch ``cfg_rank``
only, and ``finish`` takes the other branch's predictions (``peer``) from the stage group that ran it.  Either
way the guided prediction is ``u + g * (c - u)`` in fp32 with the same operands, so both groups step the
sampler identically and stay in lockstep.  Under CFG-parallel, a stream without guidance runs on group 0 only.

Image-to-video (``StreamSpec.image_latents``, models with a timestep per token): every stage holds the stream's latent
frame 0 at the image's latent (in chunk 0's level-0 input and after every sampler step) and conditions that frame's
tokens on timestep 0 (``forward``), which is Wan2.2-TI2V's first-frame conditioning; ``check_image``
(``stagecast.model.config``) refuses it for a model with one timestep per item.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from stage_service.dit_slice import AttentionContext, Conditioning, DiTSlice
from stage_service.graphs import GraphedBlocks
from stage_service.host_copy import to_device
from stage_service.kv_cache import KVOrderError, StreamKVCache
from stage_service.parallel_state import LOCAL, SequenceGroup
from stage_service.sampler import FlowSampler, chunk_noise
from stagecast.microstep import ChunkSpecs, MicroStep, StreamSpec, context_frames, rope_offset, stream_branches
from stagecast.model.config import DiTConfig, check_image, check_spec


class UnknownStreamError(KeyError):
    def __str__(self) -> str:
        return f"unknown stream {self.args[0]}: it was never opened on this stage or has already been closed"


@dataclass
class StepResult:
    step: MicroStep
    next_latent: torch.Tensor | None  # input of the chunk's next level, if it has one
    finished: torch.Tensor | None  # the clean latent chunk, after the last denoising level


@dataclass
class _Stream:
    spec: StreamSpec
    kv: dict[int, StreamKVCache]  # per CFG branch this runner computes (0: conditional, 1: unconditional)
    specs: ChunkSpecs  # the spec of each chunk (step changes)
    # Prompt versions: (first chunk it applies to, per-layer text K/V); sorted by chunk.
    prompts: list[tuple[int, list[tuple[torch.Tensor, torch.Tensor]]]] = field(default_factory=list)
    latents: dict[int, tuple[int, torch.Tensor]] = field(default_factory=dict)
    negative: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # the unconditional branch's text K/V
    # Video-to-video (``spec.input_latents``): each chunk's level-0 input, from an "input" plan event.
    inputs: dict[int, torch.Tensor] = field(default_factory=dict)
    # Image-to-video (``spec.image_latents``): the clean latent of the stream's frame 0, (1, C, 1, h, w).
    image: torch.Tensor | None = None
    # A chunk's level-0 noise made ahead (``SliceRunner.prefetch_noise``), on its way to the device: (chunk, noise).
    noise_ahead: tuple[int, torch.Tensor] | None = None

    def with_image(self, chunk: int, x: torch.Tensor) -> torch.Tensor:
        """``x`` with the stream's frame 0 set to the image latent: ``(1 - mask) * condition + mask * latents`` of
        WanImageToVideoPipeline, which with a 0/1 mask is exactly this replacement."""
        if self.image is None or chunk != 0:
            return x
        x = x.clone()
        x[:, :, 0:1] = to_device(self.image, x.device).to(x.dtype)
        return x

    samplers: dict[tuple[float, ...], FlowSampler] = field(default_factory=dict)
    done_chunks: int = 0  # chunks < this have run their last level (chunks of a stream finish in order)

    def spec_at(self, chunk: int) -> StreamSpec:
        return self.specs.at(chunk)

    def sampler(self, spec: StreamSpec) -> FlowSampler:
        sampler = self.samplers.get(spec.timesteps)
        if sampler is None:
            if len(self.samplers) >= 8:  # a few ladders are in use at once; keep the cache bounded
                self.samplers.clear()
            sampler = self.samplers[spec.timesteps] = FlowSampler(spec)
        return sampler

    def cross_kv(self, chunk: int, branch: int = 0):
        if branch == 1:
            assert self.negative is not None
            return self.negative
        current = self.prompts[0][1]
        for first, kv in self.prompts:
            if first <= chunk:
                current = kv
        return current


def guided(spec: StreamSpec, step: MicroStep) -> bool:
    """Whether ``step``'s prediction is a guided combination of two branches (the clean pass has no sampler step)."""
    return spec.cfg and not spec.is_clean_pass(step.level)


def combine_guidance(cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
    """The guided flow prediction ``u + g * (c - u)`` in fp32: one expression for every executor."""
    u = uncond.float()
    return u + scale * (cond.float() - u)


def validate_batch(steps: list[MicroStep], spec_of: Callable[[MicroStep], StreamSpec]) -> None:
    """Raise ValueError (KeyError from ``spec_of`` for unknown streams) unless ``steps`` is a runnable batch:
    levels and chunks in range, one latent shape and text length, no micro-step twice.  ``spec_of(step)`` is the
    spec of the step's chunk."""
    if not steps:
        raise ValueError("a batch must hold at least one micro-step")
    shapes = set()
    for st in steps:
        spec = spec_of(st)
        if not 0 <= st.level < spec.levels:
            raise ValueError(f"{st}: level {st.level} out of range [0, {spec.levels})")
        if st.chunk < 0 or (spec.num_chunks is not None and st.chunk >= spec.num_chunks):
            raise ValueError(f"{st}: chunk {st.chunk} out of range")
        shapes.add((spec.latent_shape, spec.text_len))
    if len(shapes) != 1:
        raise ValueError(f"a batch must share one latent shape and text length, got {sorted(shapes)}")
    if len(set(steps)) != len(steps):
        raise ValueError("a batch holds the same micro-step twice")


def check_sequence_split(spec: StreamSpec, tokens_per_frame: int, sp: int) -> None:
    """A chunk's tokens are cut into ``sp`` equal sequence shards: refuse a stream whose chunk does not split."""
    tokens = tokens_per_frame * spec.chunk_frames
    if sp > 1 and tokens % sp:
        raise ValueError(
            f"stream {spec.stream_id}: a chunk of {spec.chunk_frames} latent frame(s) at "
            f"{spec.latent_height}x{spec.latent_width} is {tokens} tokens, which do not split into {sp} "
            "sequence shards (--sp)"
        )


class SliceRunner:
    """``sp``: this rank's sequence-parallel group (``stage_service.parallel_state``).  With more than one rank,
    blocks run on this rank's sequence shard: the first slice embeds the whole chunk and keeps its shard, the
    last gathers the shards before the head, and every rank runs the sampler step (all hold every latent)."""

    def __init__(
        self,
        dit_slice: DiTSlice,
        *,
        graphs: GraphedBlocks | None = None,
        sp: SequenceGroup = LOCAL,
        cfg_rank: int = 0,
        cfg_size: int = 1,
    ):
        if graphs is not None and sp.size > 1:
            raise ValueError("CUDA graphs (--cuda-graphs) do not support sequence parallelism (--sp) yet")
        if cfg_size not in (1, 2) or not 0 <= cfg_rank < cfg_size:
            raise ValueError(f"cfg_rank={cfg_rank} cfg_size={cfg_size}: CFG-parallel runs 1 or 2 groups")
        self.cfg_rank, self.cfg_size = cfg_rank, cfg_size
        self.slice = dit_slice
        self.graphs = graphs  # run the blocks as CUDA graphs (``stage_service.graphs``); None: eager
        self.sp = sp
        self.streams: dict[int, _Stream] = {}
        self.rope_limit = dit_slice.model.rope.max_seq_len
        self.model = DiTConfig.from_kwargs({**dit_slice.config, "rope_max_seq_len": self.rope_limit})

    # ---- stream lifecycle ------------------------------------------------------------------------------

    def open_stream(
        self,
        spec: StreamSpec,
        text: torch.Tensor,
        image: torch.Tensor | None = None,
        negative_text: torch.Tensor | None = None,
    ) -> None:
        """``negative_text`` (1, T, text_dim): the unconditional branch's text, required exactly when the stream is
        guided (``spec.guidance_scale > 1``)."""
        if spec.stream_id in self.streams:
            raise ValueError(f"stream {spec.stream_id} is already open on this stage")
        check_spec(spec, self.model, tuple(text.shape))
        if spec.cfg != (negative_text is not None):
            need = "needs" if spec.cfg else "takes no"
            raise ValueError(f"stream {spec.stream_id}: guidance_scale={spec.guidance_scale} {need} negative_text")
        if negative_text is not None and tuple(negative_text.shape) != tuple(text.shape):
            raise ValueError(
                f"stream {spec.stream_id}: negative_text has shape {tuple(negative_text.shape)}, "
                f"expected {tuple(text.shape)}"
            )
        check_image(spec, None if image is None else tuple(image.shape), per_token=self.slice.per_token_timesteps)
        tpf = self.slice.tokens_per_frame(spec.latent_height, spec.latent_width)
        check_sequence_split(spec, tpf, self.sp.size)
        kv = {
            b: StreamKVCache(spec, num_layers=self.slice.num_layers, tokens_per_frame=tpf, rope_limit=self.rope_limit)
            for b in self.branches(spec)
        }
        stream = _Stream(spec=spec, kv=kv, specs=ChunkSpecs(spec))
        if image is not None:
            stream.image = image.float()
        self.streams[spec.stream_id] = stream
        self.set_prompt(spec.stream_id, 0, text)
        if negative_text is not None and 1 in kv:
            with torch.no_grad():
                stream.negative = self.slice.cross_kv(
                    self.slice.embed_text(to_device(negative_text, self.slice.device))
                )

    def branches(self, spec: StreamSpec) -> tuple[int, ...]:
        return stream_branches(spec, self.cfg_rank, self.cfg_size)

    def computes(self, step: MicroStep) -> bool:
        """Whether this runner computes any row of ``step`` (CFG group 1 skips streams without guidance)."""
        return bool(self.branches(self._stream(step.stream).spec))

    def rows(self, steps: list[MicroStep]) -> list[tuple[MicroStep, int]]:
        """The batch rows this runner computes: (micro-step, CFG branch), a guided step's branches adjacent."""
        return [(st, b) for st in steps for b in self.branches(self._stream(st.stream).spec)]

    def set_prompt(self, stream_id: int, from_chunk: int, text: torch.Tensor) -> None:
        """Use ``text`` (1, T, text_dim) for chunks >= ``from_chunk``."""
        stream = self._stream(stream_id)
        expected = (1, stream.spec.text_len, self.slice.config["text_dim"])
        if tuple(text.shape) != expected:
            raise ValueError(f"stream {stream_id}: text embeddings have shape {tuple(text.shape)}, expected {expected}")
        if 0 not in self.branches(stream.spec):
            return  # CFG-parallel group 1 runs a guided stream's unconditional branch only
        with torch.no_grad():
            kv = self.slice.cross_kv(self.slice.embed_text(to_device(text, self.slice.device)))
        stream.prompts = [p for p in stream.prompts if p[0] < from_chunk] + [(from_chunk, kv)]

    def set_steps(self, stream_id: int, from_chunk: int, timesteps) -> None:
        """Chunks >= ``from_chunk`` run ``timesteps`` (a step change; ``ChunkSpecs`` says what it means)."""
        stream = self._stream(stream_id)
        started = max([stream.done_chunks - 1, *stream.latents]) if stream.latents or stream.done_chunks else -1
        if from_chunk <= started:
            raise ValueError(f"stream {stream_id}: steps change from chunk {from_chunk}, which has already started")
        stream.specs.change(from_chunk, timesteps)

    def close_stream(self, stream_id: int) -> None:
        stream = self.streams.pop(stream_id, None)
        if stream is None:
            raise UnknownStreamError(stream_id)
        for kv in stream.kv.values():
            kv.clear()
        stream.latents.clear()
        stream.inputs.clear()
        stream.noise_ahead = None
        if self.graphs is not None:
            self.graphs.forget_text([kv for _, kv in stream.prompts] + ([stream.negative] if stream.negative else []))
        stream.prompts.clear()
        stream.negative = None

    def _stream(self, stream_id: int) -> _Stream:
        try:
            return self.streams[stream_id]
        except KeyError:
            raise UnknownStreamError(stream_id) from None

    def spec(self, stream_id: int) -> StreamSpec:
        return self._stream(stream_id).spec

    def spec_at(self, stream_id: int, chunk: int) -> StreamSpec:
        """The spec of one chunk of the stream: its ladder after any step change."""
        return self._stream(stream_id).spec_at(chunk)

    def memory_bytes(self) -> dict[str, int]:
        kv = sum(c.nbytes for s in self.streams.values() for c in s.kv.values())
        texts = [p for s in self.streams.values() for p in [kv for _, kv in s.prompts] + [s.negative or []]]
        text = sum(k.numel() * k.element_size() * 2 for p in texts for k, _ in p)
        lat = sum(t.numel() * t.element_size() for s in self.streams.values() for _, t in s.latents.values())
        lat += sum(t.numel() * t.element_size() for s in self.streams.values() for t in s.inputs.values())
        graphs = self.graphs.nbytes if self.graphs is not None else 0
        return {"kv": kv, "text_kv": text, "latents": lat, "graph_buffers": graphs}

    # ---- latents --------------------------------------------------------------------------------------

    def holds_latent(self, step: MicroStep) -> bool:
        """Whether the input latent of ``step`` (a level > 0, or the clean pass) is here already."""
        stream = self.streams.get(step.stream)
        held = None if stream is None else stream.latents.get(step.chunk)
        return held is not None and held[0] == step.level

    def put_latent(self, step: MicroStep, latent: torch.Tensor) -> None:
        """Record the input latent of ``step`` (a level > 0, or the clean pass)."""
        self._stream(step.stream).latents[step.chunk] = (step.level, latent)

    def put_input(self, stream_id: int, chunk: int, latents: torch.Tensor) -> None:
        """Record a video-to-video chunk's level-0 input.  Only the first slice (it embeds it) and the last (its
        sampler step starts from it) keep it; a slice between them has no use for it."""
        stream = self._stream(stream_id)
        if not stream.spec.input_latents:
            raise ValueError(f"stream {stream_id} takes no input latents (it is not a video-to-video stream)")
        if tuple(latents.shape) != stream.spec.latent_shape:
            raise ValueError(
                f"stream {stream_id} chunk {chunk}: input latents have shape {tuple(latents.shape)}, "
                f"expected {stream.spec.latent_shape}"
            )
        if chunk in stream.inputs:
            raise ValueError(f"stream {stream_id} chunk {chunk}: input latents arrived twice")
        if (self.slice.first or self.slice.last) and self.branches(stream.spec):  # (CFG group 1 skips unguided)
            stream.inputs[chunk] = latents.float()

    def prefetch_noise(self, steps) -> None:
        """Make the level-0 noise of the chunk after each text stream's level-0 step in ``steps`` now, and start its
        copy to the device (``take_latent`` takes it): the executor calls this once a batch is launched, so the host
        draws the noise while the GPU runs that batch rather than while the next batch waits for it (a 480x832 chunk's
        noise is 100k draws on the CPU, about half a millisecond).  The same draws as ``chunk_noise`` at the take."""
        if not (self.slice.first or self.slice.last):
            return  # a slice between them takes no latents
        for st in steps:
            stream = self.streams.get(st.stream)
            if stream is None or st.level != 0 or stream.spec.input_latents or not self.computes(st):
                continue
            chunk = st.chunk + 1
            if stream.spec.num_chunks is not None and chunk >= stream.spec.num_chunks:
                continue
            stream.noise_ahead = (chunk, to_device(chunk_noise(stream.spec, chunk, 0), self.slice.device))

    def _noise(self, stream: _Stream, chunk: int) -> torch.Tensor:
        """Chunk ``chunk``'s level-0 noise: the one made ahead for it, or drawn now."""
        ahead = stream.noise_ahead
        if ahead is not None and ahead[0] <= chunk:
            stream.noise_ahead = None  # taken, or for a chunk that is past
            if ahead[0] == chunk:
                return ahead[1]
        return chunk_noise(stream.spec, chunk, 0)

    def take_latent(self, step: MicroStep) -> torch.Tensor:
        stream = self._stream(step.stream)
        if step.level == 0:
            if not stream.spec.input_latents:
                return stream.with_image(step.chunk, self._noise(stream, step.chunk))
            latent = stream.inputs.pop(step.chunk, None)
            if latent is None:
                raise KVOrderError(f"{step}: its input latents have not arrived; plan out of order")
            return stream.with_image(step.chunk, latent)
        held = stream.latents.pop(step.chunk, None)
        if held is None or held[0] != step.level:
            have = None if held is None else held[0]
            raise KVOrderError(f"{step}: its input latent is not here (holding level {have}); plan out of order")
        return held[1]

    # ---- execution ------------------------------------------------------------------------------------

    def check_batch(self, steps: list[MicroStep]) -> None:
        validate_batch(steps, lambda st: self._stream(st.stream).spec_at(st.chunk))

    @torch.no_grad()
    def forward(self, steps: list[MicroStep], inputs: torch.Tensor | None = None) -> torch.Tensor:
        """Run the slice over a batch: one row per (micro-step, CFG branch) of ``rows(steps)``, which must not be
        empty.  First slice: latents from the store (``inputs`` must be None).  Other slices: ``inputs`` are the
        previous slice's hidden states.  Returns hidden states, or the flow prediction on the last slice."""
        self.check_batch(steps)
        sl = self.slice
        rows = self.rows(steps)
        if not rows:
            raise ValueError("no row of this batch runs on this runner (see rows())")
        streams = [self._stream(st.stream) for st, _ in rows]
        for s in streams:
            s.specs.prune(s.done_chunks)
        specs = [s.spec_at(st.chunk) for s, (st, _) in zip(streams, rows)]
        spec0 = specs[0]
        _, _, f, h, w = spec0.latent_shape
        hidden = self._input_hidden(steps, rows, inputs)
        tokens = hidden.shape[1] * self.sp.size
        timesteps = self._timesteps(streams, specs, rows, tokens, f)
        cond = sl.condition(timesteps, tokens=tokens)
        block_cond = cond
        if self.sp.size > 1 and cond.timestep_proj.ndim == 4:  # per-token timesteps: this rank's tokens only
            block_cond = Conditioning(temb=cond.temb, timestep_proj=self._shard(cond.timestep_proj))
        offsets = [rope_offset(spec, st.chunk, self.rope_limit) for spec, (st, _) in zip(specs, rows)]
        views = [s.kv[b].view(st, spec) for s, spec, (st, b) in zip(streams, specs, rows)]
        ctx = AttentionContext(
            rotary=sl.rotary(f, h, w, offsets),
            cross_kv=[s.cross_kv(st.chunk, b) for s, (st, b) in zip(streams, rows)],
            self_kv=list(views),
            sp=self.sp,
        )
        if self.graphs is not None:
            # A batch of warm-up streams only (the gateway's, before it serves) captures its graph in line.
            hidden = self.graphs.run(hidden, block_cond, ctx, inline=all(spec.warmup for spec in specs))
        else:
            hidden = sl.run_blocks(hidden, block_cond, ctx)
        for s, (_, b), view in zip(streams, rows, views):
            s.kv[b].commit(view)
        self._mark_done(streams, specs, rows)
        if sl.last:
            if self.sp.size > 1:
                hidden = torch.cat(self.sp.all_gather(hidden), dim=1)
            return sl.head(hidden, cond, (len(rows), *spec0.latent_shape[1:]))
        return hidden

    def _input_hidden(self, steps: list[MicroStep], rows, inputs: torch.Tensor | None) -> torch.Tensor:
        """The batch's hidden states entering this slice: embedded latents from the store on the first slice, the
        previous slice's hidden states on the others."""
        sl = self.slice
        if not sl.first:
            if inputs is None:
                raise ValueError("a slice after the first needs the previous slice's hidden states")
            return inputs
        if inputs is not None:
            raise ValueError("the first slice takes its latents from the store, not from inputs")
        latents = {st: to_device(self.take_latent(st), sl.device) for st in steps if self.computes(st)}
        if sl.last:
            # One process owns both ends: remember each input for the sampler step in finish().
            self._inputs = latents
        hidden = sl.embed(torch.cat([latents[st] for st, _ in rows], dim=0).to(sl.device))
        return self._shard(hidden)

    @staticmethod
    def _timesteps(streams, specs, rows, tokens: int, frames: int) -> torch.Tensor:
        """Each row's model timestep; per token when a row is an image-to-video stream's first chunk."""
        timesteps = torch.tensor(
            [s.sampler(spec).model_timestep(st.level) for s, spec, (st, _) in zip(streams, specs, rows)]
        )
        if any(s.image is not None and st.chunk == 0 for s, (st, _) in zip(streams, rows)):
            # Image-to-video: the image frame's tokens are at timestep 0, the others at the level's (per token).
            timesteps = timesteps[:, None].expand(-1, tokens).clone()
            tpf = tokens // frames
            for i, (s, (st, _)) in enumerate(zip(streams, rows)):
                if s.image is not None and st.chunk == 0:
                    timesteps[i, :tpf] = 0.0
        return timesteps

    @staticmethod
    def _mark_done(streams, specs, rows) -> None:
        """A row at its chunk's last level finishes the chunk: the stream's done count moves on and its KV prunes."""
        for s, spec, (st, _) in zip(streams, specs, rows):
            if st.level == spec.levels - 1:
                s.done_chunks = max(s.done_chunks, st.chunk + 1)
                for kv in s.kv.values():
                    kv.prune(s.done_chunks)  # a step change's earlier KV segment is over once its last chunk is

    def exchanged_rows(self, steps: list[MicroStep], flow: torch.Tensor) -> torch.Tensor | None:
        """CFG-parallel, last slice: this group's predictions of the guided steps, in step order, for the other
        group (None when the batch has no guided step)."""
        rows = self.rows(steps)
        idx = [i for i, (st, _) in enumerate(rows) if guided(self._stream(st.stream).spec_at(st.chunk), st)]
        return flow[idx] if idx else None

    def guided_count(self, steps: list[MicroStep]) -> int:
        return sum(1 for st in steps if self.computes(st) and guided(self._stream(st.stream).spec_at(st.chunk), st))

    def recaches(self, stream_id: int) -> bool:
        """Whether this runner holds the stream's conditional KV (a CFG group's peer may hold none of it)."""
        return 0 in self._stream(stream_id).kv

    @torch.no_grad()
    def recache_step(
        self,
        stream_id: int,
        chunk: int,
        row: int,
        from_chunk: int,
        *,
        clean: torch.Tensor | None = None,
        inputs: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """One forward of a recache (``stagecast.microstep.recache_steps``): rebuild KV row ``row`` for ``chunk``'s
        window frames under the stream's newest prompt.  First slice: ``clean`` is the chunk's clean latent; other
        slices: ``inputs`` the previous slice's hidden states.  Returns the hidden states for the next slice (None on
        the last: a recache produces no latent)."""
        if self.sp.size > 1:
            raise ValueError("a recache under sequence parallelism is not supported")
        sl = self.slice
        stream = self._stream(stream_id)
        spec = stream.spec_at(from_chunk)  # the window as the next chunk sees it, on the ladder it runs
        if spec.cfg:
            raise ValueError(f"stream {stream_id}: a recache of a guided stream is not supported")
        sampler = stream.sampler(spec)
        _, _, f, h, w = spec.latent_shape
        if sl.first:
            if clean is None:
                raise ValueError(f"recache of stream {stream_id} chunk {chunk}: the first slice needs its clean latent")
            x = clean.float()
            if spec.policy == "per_level":  # row r is rebuilt from the clean latent re-noised to level r
                sigma = sampler.sigmas[row]
                x = (1.0 - sigma) * x + sigma * chunk_noise(spec, chunk, row)
            hidden = sl.embed(to_device(stream.with_image(chunk, x), sl.device))
        else:
            if inputs is None:
                raise ValueError("a slice after the first needs the previous slice's hidden states")
            hidden = inputs
        tokens = hidden.shape[1]
        t = 0.0 if spec.policy == "clean" else sampler.model_timestep(row)
        timesteps = torch.tensor([t])
        if stream.image is not None and chunk == 0:
            timesteps = timesteps[:, None].expand(-1, tokens).clone()
            timesteps[0, : tokens // f] = 0.0
        cond = sl.condition(timesteps, tokens=tokens)
        window = context_frames(spec, from_chunk, self.rope_limit)
        view = stream.kv[0].recache_view(chunk, row, window)
        ctx = AttentionContext(
            rotary=sl.rotary(f, h, w, [rope_offset(spec, chunk, self.rope_limit)]),
            cross_kv=[stream.prompts[-1][1]],
            self_kv=[view],
            sp=self.sp,
        )
        hidden = sl.run_blocks(hidden, cond, ctx)
        stream.kv[0].commit_recache(view)
        return None if sl.last else hidden

    def _shard(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's sequence shard of a (B, L, ...) tensor."""
        if self.sp.size == 1:
            return tensor
        tokens = tensor.shape[1] // self.sp.size
        return tensor[:, self.sp.rank * tokens : (self.sp.rank + 1) * tokens].contiguous()

    @torch.no_grad()
    def finish(self, steps: list[MicroStep], flow: torch.Tensor, peer: torch.Tensor | None = None) -> list[StepResult]:
        """Last slice: apply the sampler step to every item this runner computes and route the results.
        ``peer`` (CFG-parallel): the other group's predictions of the guided steps, as ``exchanged_rows``."""
        if not self.slice.last:
            raise RuntimeError("finish() belongs to the last slice")
        mine = [st for st in steps if self.computes(st)]
        if self.slice.first:
            inputs = self._inputs
            self._inputs = {}
        else:
            # Level 0 of a text stream is noise the last slice regenerates; of a video-to-video stream, the input.
            inputs = {st: self.take_latent(st) for st in mine}
        rows = self.rows(steps)
        expected_peer = self.guided_count(steps) if self.cfg_size == 2 else 0
        have_peer = 0 if peer is None else peer.shape[0]
        if have_peer != expected_peer:
            raise ValueError(f"the other CFG group sent {have_peer} guided predictions, this batch has {expected_peer}")
        results = []
        r = p = 0
        for st in mine:
            stream = self._stream(st.stream)
            spec = stream.spec_at(st.chunk)
            branches = self.branches(spec)
            own = {b: flow[r + k : r + k + 1] for k, b in enumerate(branches)}
            r += len(branches)
            if spec.is_clean_pass(st.level):
                results.append(StepResult(st, None, None))
                continue
            if spec.cfg:
                if len(branches) == 1:
                    own[1 - branches[0]] = peer[p : p + 1]  # type: ignore[index]
                    p += 1
                v = combine_guidance(own[0], own[1].to(own[0].device), spec.guidance_scale)
            else:
                v = own[0]
            x = to_device(inputs[st], flow.device)
            nxt = stream.sampler(spec).step(
                x, v, st.level, noise=lambda st=st, spec=spec: chunk_noise(spec, st.chunk, st.level + 1)
            )
            nxt = stream.with_image(st.chunk, nxt)  # the image frame stays the image, as the pipeline's output
            finished = nxt if st.level == spec.steps - 1 else None
            has_next = st.level + 1 < spec.levels
            if has_next:
                self.put_latent(MicroStep(st.stream, st.chunk, st.level + 1), nxt)
            results.append(StepResult(st, nxt if has_next else None, finished))
        assert r == len(rows)
        return results
