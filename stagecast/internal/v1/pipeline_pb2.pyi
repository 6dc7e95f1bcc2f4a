from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tensor(_message.Message):
    __slots__ = ("shape", "dtype", "data", "zero_tail")
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    ZERO_TAIL_FIELD_NUMBER: _ClassVar[int]
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    data: bytes
    zero_tail: bool
    def __init__(self, shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., data: _Optional[bytes] = ..., zero_tail: _Optional[bool] = ...) -> None: ...

class StreamSpec(_message.Message):
    __slots__ = ("stream_id", "latent_channels", "chunk_frames", "latent_height", "latent_width", "timesteps", "shift", "seed", "policy", "window", "sink", "reset_frames", "sampler", "num_chunks", "text_len", "input_latents", "image_latents", "guidance_scale", "warmup")
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    LATENT_CHANNELS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FRAMES_FIELD_NUMBER: _ClassVar[int]
    LATENT_HEIGHT_FIELD_NUMBER: _ClassVar[int]
    LATENT_WIDTH_FIELD_NUMBER: _ClassVar[int]
    TIMESTEPS_FIELD_NUMBER: _ClassVar[int]
    SHIFT_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    SINK_FIELD_NUMBER: _ClassVar[int]
    RESET_FRAMES_FIELD_NUMBER: _ClassVar[int]
    SAMPLER_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    TEXT_LEN_FIELD_NUMBER: _ClassVar[int]
    INPUT_LATENTS_FIELD_NUMBER: _ClassVar[int]
    IMAGE_LATENTS_FIELD_NUMBER: _ClassVar[int]
    GUIDANCE_SCALE_FIELD_NUMBER: _ClassVar[int]
    WARMUP_FIELD_NUMBER: _ClassVar[int]
    stream_id: int
    latent_channels: int
    chunk_frames: int
    latent_height: int
    latent_width: int
    timesteps: _containers.RepeatedScalarFieldContainer[float]
    shift: float
    seed: int
    policy: str
    window: int
    sink: int
    reset_frames: int
    sampler: str
    num_chunks: int
    text_len: int
    input_latents: bool
    image_latents: bool
    guidance_scale: float
    warmup: bool
    def __init__(self, stream_id: _Optional[int] = ..., latent_channels: _Optional[int] = ..., chunk_frames: _Optional[int] = ..., latent_height: _Optional[int] = ..., latent_width: _Optional[int] = ..., timesteps: _Optional[_Iterable[float]] = ..., shift: _Optional[float] = ..., seed: _Optional[int] = ..., policy: _Optional[str] = ..., window: _Optional[int] = ..., sink: _Optional[int] = ..., reset_frames: _Optional[int] = ..., sampler: _Optional[str] = ..., num_chunks: _Optional[int] = ..., text_len: _Optional[int] = ..., input_latents: _Optional[bool] = ..., image_latents: _Optional[bool] = ..., guidance_scale: _Optional[float] = ..., warmup: _Optional[bool] = ...) -> None: ...

class MicroStep(_message.Message):
    __slots__ = ("stream", "chunk", "level")
    STREAM_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    stream: int
    chunk: int
    level: int
    def __init__(self, stream: _Optional[int] = ..., chunk: _Optional[int] = ..., level: _Optional[int] = ...) -> None: ...

class OpenStream(_message.Message):
    __slots__ = ("spec", "text", "image", "negative_text")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    NEGATIVE_TEXT_FIELD_NUMBER: _ClassVar[int]
    spec: StreamSpec
    text: Tensor
    image: Tensor
    negative_text: Tensor
    def __init__(self, spec: _Optional[_Union[StreamSpec, _Mapping]] = ..., text: _Optional[_Union[Tensor, _Mapping]] = ..., image: _Optional[_Union[Tensor, _Mapping]] = ..., negative_text: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class MicroBatch(_message.Message):
    __slots__ = ("steps",)
    STEPS_FIELD_NUMBER: _ClassVar[int]
    steps: _containers.RepeatedCompositeFieldContainer[MicroStep]
    def __init__(self, steps: _Optional[_Iterable[_Union[MicroStep, _Mapping]]] = ...) -> None: ...

class InputLatents(_message.Message):
    __slots__ = ("stream_id", "chunk", "latents")
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    LATENTS_FIELD_NUMBER: _ClassVar[int]
    stream_id: int
    chunk: int
    latents: Tensor
    def __init__(self, stream_id: _Optional[int] = ..., chunk: _Optional[int] = ..., latents: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class CloseStream(_message.Message):
    __slots__ = ("stream_id",)
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    stream_id: int
    def __init__(self, stream_id: _Optional[int] = ...) -> None: ...

class WindowChunk(_message.Message):
    __slots__ = ("chunk", "latents")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    LATENTS_FIELD_NUMBER: _ClassVar[int]
    chunk: int
    latents: Tensor
    def __init__(self, chunk: _Optional[int] = ..., latents: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class PromptUpdate(_message.Message):
    __slots__ = ("stream_id", "from_chunk", "text", "recache", "window")
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    FROM_CHUNK_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    RECACHE_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    stream_id: int
    from_chunk: int
    text: Tensor
    recache: bool
    window: _containers.RepeatedCompositeFieldContainer[WindowChunk]
    def __init__(self, stream_id: _Optional[int] = ..., from_chunk: _Optional[int] = ..., text: _Optional[_Union[Tensor, _Mapping]] = ..., recache: _Optional[bool] = ..., window: _Optional[_Iterable[_Union[WindowChunk, _Mapping]]] = ...) -> None: ...

class StepsUpdate(_message.Message):
    __slots__ = ("stream_id", "from_chunk", "timesteps")
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    FROM_CHUNK_FIELD_NUMBER: _ClassVar[int]
    TIMESTEPS_FIELD_NUMBER: _ClassVar[int]
    stream_id: int
    from_chunk: int
    timesteps: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, stream_id: _Optional[int] = ..., from_chunk: _Optional[int] = ..., timesteps: _Optional[_Iterable[float]] = ...) -> None: ...

class PlanEvent(_message.Message):
    __slots__ = ("generation", "seq", "open", "batch", "close", "prompt", "input", "steps", "traceparent")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    OPEN_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    CLOSE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    INPUT_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    generation: int
    seq: int
    open: OpenStream
    batch: MicroBatch
    close: CloseStream
    prompt: PromptUpdate
    input: InputLatents
    steps: StepsUpdate
    traceparent: str
    def __init__(self, generation: _Optional[int] = ..., seq: _Optional[int] = ..., open: _Optional[_Union[OpenStream, _Mapping]] = ..., batch: _Optional[_Union[MicroBatch, _Mapping]] = ..., close: _Optional[_Union[CloseStream, _Mapping]] = ..., prompt: _Optional[_Union[PromptUpdate, _Mapping]] = ..., input: _Optional[_Union[InputLatents, _Mapping]] = ..., steps: _Optional[_Union[StepsUpdate, _Mapping]] = ..., traceparent: _Optional[str] = ...) -> None: ...

class SubmitReply(_message.Message):
    __slots__ = ("accepted_seq",)
    ACCEPTED_SEQ_FIELD_NUMBER: _ClassVar[int]
    accepted_seq: int
    def __init__(self, accepted_seq: _Optional[int] = ...) -> None: ...

class ChunkResult(_message.Message):
    __slots__ = ("stream_id", "chunk", "latents", "seq", "steps", "finished_with")
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    LATENTS_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_WITH_FIELD_NUMBER: _ClassVar[int]
    stream_id: int
    chunk: int
    latents: Tensor
    seq: int
    steps: int
    finished_with: int
    def __init__(self, stream_id: _Optional[int] = ..., chunk: _Optional[int] = ..., latents: _Optional[_Union[Tensor, _Mapping]] = ..., seq: _Optional[int] = ..., steps: _Optional[int] = ..., finished_with: _Optional[int] = ...) -> None: ...

class BatchDone(_message.Message):
    __slots__ = ("seq", "forward_ms", "wait_ms", "micro_steps", "exchange_ms", "batches", "eager", "timed")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    FORWARD_MS_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    MICRO_STEPS_FIELD_NUMBER: _ClassVar[int]
    EXCHANGE_MS_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    EAGER_FIELD_NUMBER: _ClassVar[int]
    TIMED_FIELD_NUMBER: _ClassVar[int]
    seq: int
    forward_ms: float
    wait_ms: float
    micro_steps: int
    exchange_ms: float
    batches: int
    eager: bool
    timed: _containers.RepeatedCompositeFieldContainer[BatchTime]
    def __init__(self, seq: _Optional[int] = ..., forward_ms: _Optional[float] = ..., wait_ms: _Optional[float] = ..., micro_steps: _Optional[int] = ..., exchange_ms: _Optional[float] = ..., batches: _Optional[int] = ..., eager: _Optional[bool] = ..., timed: _Optional[_Iterable[_Union[BatchTime, _Mapping]]] = ...) -> None: ...

class BatchTime(_message.Message):
    __slots__ = ("forward_ms", "micro_steps", "eager")
    FORWARD_MS_FIELD_NUMBER: _ClassVar[int]
    MICRO_STEPS_FIELD_NUMBER: _ClassVar[int]
    EAGER_FIELD_NUMBER: _ClassVar[int]
    forward_ms: float
    micro_steps: int
    eager: bool
    def __init__(self, forward_ms: _Optional[float] = ..., micro_steps: _Optional[int] = ..., eager: _Optional[bool] = ...) -> None: ...

class StageError(_message.Message):
    __slots__ = ("generation", "seq", "message", "stage_index")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    STAGE_INDEX_FIELD_NUMBER: _ClassVar[int]
    generation: int
    seq: int
    message: str
    stage_index: int
    def __init__(self, generation: _Optional[int] = ..., seq: _Optional[int] = ..., message: _Optional[str] = ..., stage_index: _Optional[int] = ...) -> None: ...

class StageEvent(_message.Message):
    __slots__ = ("chunk", "done", "error")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    chunk: ChunkResult
    done: BatchDone
    error: StageError
    def __init__(self, chunk: _Optional[_Union[ChunkResult, _Mapping]] = ..., done: _Optional[_Union[BatchDone, _Mapping]] = ..., error: _Optional[_Union[StageError, _Mapping]] = ...) -> None: ...

class ResultsRequest(_message.Message):
    __slots__ = ("generation",)
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    generation: int
    def __init__(self, generation: _Optional[int] = ...) -> None: ...

class Rendezvous(_message.Message):
    __slots__ = ("generation", "rank", "world_size", "backend", "layer_start", "layer_stop", "sp", "cfg_parallel")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_STOP_FIELD_NUMBER: _ClassVar[int]
    SP_FIELD_NUMBER: _ClassVar[int]
    CFG_PARALLEL_FIELD_NUMBER: _ClassVar[int]
    generation: int
    rank: int
    world_size: int
    backend: str
    layer_start: int
    layer_stop: int
    sp: int
    cfg_parallel: int
    def __init__(self, generation: _Optional[int] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., backend: _Optional[str] = ..., layer_start: _Optional[int] = ..., layer_stop: _Optional[int] = ..., sp: _Optional[int] = ..., cfg_parallel: _Optional[int] = ...) -> None: ...

class FormReply(_message.Message):
    __slots__ = ("rank", "load_seconds", "calibration", "kv_budget_bytes", "kv_element_bytes", "cuda_graphs")
    RANK_FIELD_NUMBER: _ClassVar[int]
    LOAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CALIBRATION_FIELD_NUMBER: _ClassVar[int]
    KV_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_ELEMENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    CUDA_GRAPHS_FIELD_NUMBER: _ClassVar[int]
    rank: int
    load_seconds: float
    calibration: StageCalibration
    kv_budget_bytes: int
    kv_element_bytes: int
    cuda_graphs: bool
    def __init__(self, rank: _Optional[int] = ..., load_seconds: _Optional[float] = ..., calibration: _Optional[_Union[StageCalibration, _Mapping]] = ..., kv_budget_bytes: _Optional[int] = ..., kv_element_bytes: _Optional[int] = ..., cuda_graphs: _Optional[bool] = ...) -> None: ...

class StageCalibration(_message.Message):
    __slots__ = ("empty_ms", "full_ms", "latent_height", "latent_width", "chunk_frames", "text_len", "window", "graphs", "seconds", "error")
    EMPTY_MS_FIELD_NUMBER: _ClassVar[int]
    FULL_MS_FIELD_NUMBER: _ClassVar[int]
    LATENT_HEIGHT_FIELD_NUMBER: _ClassVar[int]
    LATENT_WIDTH_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FRAMES_FIELD_NUMBER: _ClassVar[int]
    TEXT_LEN_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    GRAPHS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    empty_ms: _containers.RepeatedScalarFieldContainer[float]
    full_ms: _containers.RepeatedScalarFieldContainer[float]
    latent_height: int
    latent_width: int
    chunk_frames: int
    text_len: int
    window: int
    graphs: bool
    seconds: float
    error: str
    def __init__(self, empty_ms: _Optional[_Iterable[float]] = ..., full_ms: _Optional[_Iterable[float]] = ..., latent_height: _Optional[int] = ..., latent_width: _Optional[int] = ..., chunk_frames: _Optional[int] = ..., text_len: _Optional[int] = ..., window: _Optional[int] = ..., graphs: _Optional[bool] = ..., seconds: _Optional[float] = ..., error: _Optional[str] = ...) -> None: ...

class ResetRequest(_message.Message):
    __slots__ = ("generation", "reason")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    generation: int
    reason: str
    def __init__(self, generation: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class Empty(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StageDescription(_message.Message):
    __slots__ = ("index", "address", "model_config_json", "layer_start", "layer_stop", "generation", "open_streams", "device", "kv_bytes", "formed", "kv_budget_bytes", "kv_reserved_bytes")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODEL_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_STOP_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    OPEN_STREAMS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    FORMED_FIELD_NUMBER: _ClassVar[int]
    KV_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_RESERVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    index: int
    address: str
    model_config_json: str
    layer_start: int
    layer_stop: int
    generation: int
    open_streams: int
    device: str
    kv_bytes: int
    formed: bool
    kv_budget_bytes: int
    kv_reserved_bytes: int
    def __init__(self, index: _Optional[int] = ..., address: _Optional[str] = ..., model_config_json: _Optional[str] = ..., layer_start: _Optional[int] = ..., layer_stop: _Optional[int] = ..., generation: _Optional[int] = ..., open_streams: _Optional[int] = ..., device: _Optional[str] = ..., kv_bytes: _Optional[int] = ..., formed: _Optional[bool] = ..., kv_budget_bytes: _Optional[int] = ..., kv_reserved_bytes: _Optional[int] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("index", "address", "model_config_json", "expected_world_size", "device", "sp")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODEL_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    SP_FIELD_NUMBER: _ClassVar[int]
    index: int
    address: str
    model_config_json: str
    expected_world_size: int
    device: str
    sp: int
    def __init__(self, index: _Optional[int] = ..., address: _Optional[str] = ..., model_config_json: _Optional[str] = ..., expected_world_size: _Optional[int] = ..., device: _Optional[str] = ..., sp: _Optional[int] = ...) -> None: ...

class RegisterReply(_message.Message):
    __slots__ = ("world_size", "layer_start", "layer_stop", "generation", "max_batch")
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_STOP_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    world_size: int
    layer_start: int
    layer_stop: int
    generation: int
    max_batch: int
    def __init__(self, world_size: _Optional[int] = ..., layer_start: _Optional[int] = ..., layer_stop: _Optional[int] = ..., generation: _Optional[int] = ..., max_batch: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("index", "address", "generation")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    index: int
    address: str
    generation: int
    def __init__(self, index: _Optional[int] = ..., address: _Optional[str] = ..., generation: _Optional[int] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("rejoin", "reason", "generation")
    REJOIN_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    rejoin: bool
    reason: str
    generation: int
    def __init__(self, rejoin: _Optional[bool] = ..., reason: _Optional[str] = ..., generation: _Optional[int] = ...) -> None: ...

class OpenStreamRequest(_message.Message):
    __slots__ = ("spec", "text", "image", "negative_text", "traceparent", "acknowledges", "consumer_depth", "chunk_rate", "ladders", "latency_first", "pace_offset_s", "decoder", "hold")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    NEGATIVE_TEXT_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    ACKNOWLEDGES_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_DEPTH_FIELD_NUMBER: _ClassVar[int]
    CHUNK_RATE_FIELD_NUMBER: _ClassVar[int]
    LADDERS_FIELD_NUMBER: _ClassVar[int]
    LATENCY_FIRST_FIELD_NUMBER: _ClassVar[int]
    PACE_OFFSET_S_FIELD_NUMBER: _ClassVar[int]
    DECODER_FIELD_NUMBER: _ClassVar[int]
    HOLD_FIELD_NUMBER: _ClassVar[int]
    spec: StreamSpec
    text: Tensor
    image: Tensor
    negative_text: Tensor
    traceparent: str
    acknowledges: bool
    consumer_depth: int
    chunk_rate: float
    ladders: _containers.RepeatedCompositeFieldContainer[Ladder]
    latency_first: bool
    pace_offset_s: float
    decoder: str
    hold: str
    def __init__(self, spec: _Optional[_Union[StreamSpec, _Mapping]] = ..., text: _Optional[_Union[Tensor, _Mapping]] = ..., image: _Optional[_Union[Tensor, _Mapping]] = ..., negative_text: _Optional[_Union[Tensor, _Mapping]] = ..., traceparent: _Optional[str] = ..., acknowledges: _Optional[bool] = ..., consumer_depth: _Optional[int] = ..., chunk_rate: _Optional[float] = ..., ladders: _Optional[_Iterable[_Union[Ladder, _Mapping]]] = ..., latency_first: _Optional[bool] = ..., pace_offset_s: _Optional[float] = ..., decoder: _Optional[str] = ..., hold: _Optional[str] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("open", "text_shape")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    TEXT_SHAPE_FIELD_NUMBER: _ClassVar[int]
    open: OpenStreamRequest
    text_shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, open: _Optional[_Union[OpenStreamRequest, _Mapping]] = ..., text_shape: _Optional[_Iterable[int]] = ...) -> None: ...

class ReserveReply(_message.Message):
    __slots__ = ("hold", "hold_s")
    HOLD_FIELD_NUMBER: _ClassVar[int]
    HOLD_S_FIELD_NUMBER: _ClassVar[int]
    hold: str
    hold_s: float
    def __init__(self, hold: _Optional[str] = ..., hold_s: _Optional[float] = ...) -> None: ...

class Ladder(_message.Message):
    __slots__ = ("timesteps",)
    TIMESTEPS_FIELD_NUMBER: _ClassVar[int]
    timesteps: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, timesteps: _Optional[_Iterable[float]] = ...) -> None: ...

class ChunksConsumed(_message.Message):
    __slots__ = ("stream_id", "chunks")
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    stream_id: int
    chunks: int
    def __init__(self, stream_id: _Optional[int] = ..., chunks: _Optional[int] = ...) -> None: ...

class VaeCost(_message.Message):
    __slots__ = ("chunk_ms", "parts", "latent_height", "latent_width", "device", "decoder", "batch_ms", "state_bytes", "formed_batch")
    CHUNK_MS_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    LATENT_HEIGHT_FIELD_NUMBER: _ClassVar[int]
    LATENT_WIDTH_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DECODER_FIELD_NUMBER: _ClassVar[int]
    BATCH_MS_FIELD_NUMBER: _ClassVar[int]
    STATE_BYTES_FIELD_NUMBER: _ClassVar[int]
    FORMED_BATCH_FIELD_NUMBER: _ClassVar[int]
    chunk_ms: float
    parts: int
    latent_height: int
    latent_width: int
    device: str
    decoder: str
    batch_ms: _containers.RepeatedScalarFieldContainer[float]
    state_bytes: int
    formed_batch: float
    def __init__(self, chunk_ms: _Optional[float] = ..., parts: _Optional[int] = ..., latent_height: _Optional[int] = ..., latent_width: _Optional[int] = ..., device: _Optional[str] = ..., decoder: _Optional[str] = ..., batch_ms: _Optional[_Iterable[float]] = ..., state_bytes: _Optional[int] = ..., formed_batch: _Optional[float] = ...) -> None: ...

class StreamProgress(_message.Message):
    __slots__ = ("stream_id", "started", "received", "consumed", "bound", "max_lead", "steps", "chunk_rate")
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_FIELD_NUMBER: _ClassVar[int]
    CONSUMED_FIELD_NUMBER: _ClassVar[int]
    BOUND_FIELD_NUMBER: _ClassVar[int]
    MAX_LEAD_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_RATE_FIELD_NUMBER: _ClassVar[int]
    stream_id: int
    started: int
    received: int
    consumed: int
    bound: int
    max_lead: int
    steps: int
    chunk_rate: float
    def __init__(self, stream_id: _Optional[int] = ..., started: _Optional[int] = ..., received: _Optional[int] = ..., consumed: _Optional[int] = ..., bound: _Optional[int] = ..., max_lead: _Optional[int] = ..., steps: _Optional[int] = ..., chunk_rate: _Optional[float] = ...) -> None: ...

class Capacity(_message.Message):
    __slots__ = ("steps", "streams", "decoder")
    STEPS_FIELD_NUMBER: _ClassVar[int]
    STREAMS_FIELD_NUMBER: _ClassVar[int]
    DECODER_FIELD_NUMBER: _ClassVar[int]
    steps: int
    streams: float
    decoder: str
    def __init__(self, steps: _Optional[int] = ..., streams: _Optional[float] = ..., decoder: _Optional[str] = ...) -> None: ...

class DecoderCostStatus(_message.Message):
    __slots__ = ("decoder", "chunk_ms", "batch_ms", "state_bytes", "source", "capacity", "formed_batch")
    DECODER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_MS_FIELD_NUMBER: _ClassVar[int]
    BATCH_MS_FIELD_NUMBER: _ClassVar[int]
    STATE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    FORMED_BATCH_FIELD_NUMBER: _ClassVar[int]
    decoder: str
    chunk_ms: float
    batch_ms: _containers.RepeatedScalarFieldContainer[float]
    state_bytes: int
    source: str
    capacity: _containers.RepeatedCompositeFieldContainer[Capacity]
    formed_batch: float
    def __init__(self, decoder: _Optional[str] = ..., chunk_ms: _Optional[float] = ..., batch_ms: _Optional[_Iterable[float]] = ..., state_bytes: _Optional[int] = ..., source: _Optional[str] = ..., capacity: _Optional[_Iterable[_Union[Capacity, _Mapping]]] = ..., formed_batch: _Optional[float] = ...) -> None: ...

class StreamStarted(_message.Message):
    __slots__ = ("stream_id", "generation")
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    stream_id: int
    generation: int
    def __init__(self, stream_id: _Optional[int] = ..., generation: _Optional[int] = ...) -> None: ...

class StreamEnded(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class StreamEvent(_message.Message):
    __slots__ = ("started", "chunk", "ended")
    STARTED_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    ENDED_FIELD_NUMBER: _ClassVar[int]
    started: StreamStarted
    chunk: ChunkResult
    ended: StreamEnded
    def __init__(self, started: _Optional[_Union[StreamStarted, _Mapping]] = ..., chunk: _Optional[_Union[ChunkResult, _Mapping]] = ..., ended: _Optional[_Union[StreamEnded, _Mapping]] = ...) -> None: ...

class StopRequest(_message.Message):
    __slots__ = ("stream_id",)
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    stream_id: int
    def __init__(self, stream_id: _Optional[int] = ...) -> None: ...

class PlanRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PlanDump(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[PlanEvent]
    def __init__(self, events: _Optional[_Iterable[_Union[PlanEvent, _Mapping]]] = ...) -> None: ...

class StageStats(_message.Message):
    __slots__ = ("index", "batches", "forward_ms_total", "wait_ms_total", "micro_steps", "exchange_ms_total", "eager_batches")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    FORWARD_MS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    MICRO_STEPS_FIELD_NUMBER: _ClassVar[int]
    EXCHANGE_MS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    EAGER_BATCHES_FIELD_NUMBER: _ClassVar[int]
    index: int
    batches: int
    forward_ms_total: float
    wait_ms_total: float
    micro_steps: int
    exchange_ms_total: float
    eager_batches: int
    def __init__(self, index: _Optional[int] = ..., batches: _Optional[int] = ..., forward_ms_total: _Optional[float] = ..., wait_ms_total: _Optional[float] = ..., micro_steps: _Optional[int] = ..., exchange_ms_total: _Optional[float] = ..., eager_batches: _Optional[int] = ...) -> None: ...

class StartupStep(_message.Message):
    __slots__ = ("name", "done", "total", "at_s", "detail")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    AT_S_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    name: str
    done: int
    total: int
    at_s: float
    detail: str
    def __init__(self, name: _Optional[str] = ..., done: _Optional[int] = ..., total: _Optional[int] = ..., at_s: _Optional[float] = ..., detail: _Optional[str] = ...) -> None: ...

class StartupProgress(_message.Message):
    __slots__ = ("process", "steps", "ready", "ready_s", "index")
    PROCESS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    READY_S_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    process: str
    steps: _containers.RepeatedCompositeFieldContainer[StartupStep]
    ready: bool
    ready_s: float
    index: int
    def __init__(self, process: _Optional[str] = ..., steps: _Optional[_Iterable[_Union[StartupStep, _Mapping]]] = ..., ready: _Optional[bool] = ..., ready_s: _Optional[float] = ..., index: _Optional[int] = ...) -> None: ...

class ClusterStatus(_message.Message):
    __slots__ = ("generation", "ready", "world_size", "stages", "active_streams", "stage_stats", "streams", "capacity", "cfg_parallel", "vae_chunk_ms", "vae_source", "calibrated_stages", "decoders", "max_batch", "slots_free", "slots_total", "startup", "utilization")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_STREAMS_FIELD_NUMBER: _ClassVar[int]
    STAGE_STATS_FIELD_NUMBER: _ClassVar[int]
    STREAMS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    CFG_PARALLEL_FIELD_NUMBER: _ClassVar[int]
    VAE_CHUNK_MS_FIELD_NUMBER: _ClassVar[int]
    VAE_SOURCE_FIELD_NUMBER: _ClassVar[int]
    CALIBRATED_STAGES_FIELD_NUMBER: _ClassVar[int]
    DECODERS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FREE_FIELD_NUMBER: _ClassVar[int]
    SLOTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    STARTUP_FIELD_NUMBER: _ClassVar[int]
    UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    generation: int
    ready: bool
    world_size: int
    stages: _containers.RepeatedCompositeFieldContainer[StageDescription]
    active_streams: int
    stage_stats: _containers.RepeatedCompositeFieldContainer[StageStats]
    streams: _containers.RepeatedCompositeFieldContainer[StreamProgress]
    capacity: _containers.RepeatedCompositeFieldContainer[Capacity]
    cfg_parallel: int
    vae_chunk_ms: float
    vae_source: str
    calibrated_stages: _containers.RepeatedScalarFieldContainer[int]
    decoders: _containers.RepeatedCompositeFieldContainer[DecoderCostStatus]
    max_batch: int
    slots_free: int
    slots_total: int
    startup: _containers.RepeatedCompositeFieldContainer[StartupProgress]
    utilization: float
    def __init__(self, generation: _Optional[int] = ..., ready: _Optional[bool] = ..., world_size: _Optional[int] = ..., stages: _Optional[_Iterable[_Union[StageDescription, _Mapping]]] = ..., active_streams: _Optional[int] = ..., stage_stats: _Optional[_Iterable[_Union[StageStats, _Mapping]]] = ..., streams: _Optional[_Iterable[_Union[StreamProgress, _Mapping]]] = ..., capacity: _Optional[_Iterable[_Union[Capacity, _Mapping]]] = ..., cfg_parallel: _Optional[int] = ..., vae_chunk_ms: _Optional[float] = ..., vae_source: _Optional[str] = ..., calibrated_stages: _Optional[_Iterable[int]] = ..., decoders: _Optional[_Iterable[_Union[DecoderCostStatus, _Mapping]]] = ..., max_batch: _Optional[int] = ..., slots_free: _Optional[int] = ..., slots_total: _Optional[int] = ..., startup: _Optional[_Iterable[_Union[StartupProgress, _Mapping]]] = ..., utilization: _Optional[float] = ...) -> None: ...
