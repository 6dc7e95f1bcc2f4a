from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Codec(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CODEC_UNSPECIFIED: _ClassVar[Codec]
    CODEC_JPEG: _ClassVar[Codec]
    CODEC_H264: _ClassVar[Codec]
    CODEC_RAW: _ClassVar[Codec]

class KvPolicy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_POLICY_UNSPECIFIED: _ClassVar[KvPolicy]
    KV_POLICY_PER_LEVEL: _ClassVar[KvPolicy]
    KV_POLICY_CLEAN: _ClassVar[KvPolicy]

class EndReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    END_REASON_UNSPECIFIED: _ClassVar[EndReason]
    END_REASON_COMPLETED: _ClassVar[EndReason]
    END_REASON_STOPPED: _ClassVar[EndReason]
    END_REASON_INPUT_STALLED: _ClassVar[EndReason]

class InputFormat(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    INPUT_FORMAT_UNSPECIFIED: _ClassVar[InputFormat]
    INPUT_FORMAT_JPEG: _ClassVar[InputFormat]
    INPUT_FORMAT_RAW: _ClassVar[InputFormat]

class InputPacing(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    INPUT_PACING_UNSPECIFIED: _ClassVar[InputPacing]
    INPUT_PACING_LIVE: _ClassVar[InputPacing]
    INPUT_PACING_BACKPRESSURE: _ClassVar[InputPacing]

class StreamState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STREAM_STATE_UNSPECIFIED: _ClassVar[StreamState]
    STREAM_STATE_STARTING: _ClassVar[StreamState]
    STREAM_STATE_STREAMING: _ClassVar[StreamState]
    STREAM_STATE_DRAINING: _ClassVar[StreamState]

class Decoder(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DECODER_UNSPECIFIED: _ClassVar[Decoder]
    DECODER_FULL: _ClassVar[Decoder]
    DECODER_TINY: _ClassVar[Decoder]

class StepsPreference(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STEPS_PREFERENCE_UNSPECIFIED: _ClassVar[StepsPreference]
    STEPS_PREFERENCE_STEPS_FIRST: _ClassVar[StepsPreference]
    STEPS_PREFERENCE_LATENCY_FIRST: _ClassVar[StepsPreference]

class Transition(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSITION_UNSPECIFIED: _ClassVar[Transition]
    TRANSITION_CUT: _ClassVar[Transition]
    TRANSITION_RECACHE: _ClassVar[Transition]
CODEC_UNSPECIFIED: Codec
CODEC_JPEG: Codec
CODEC_H264: Codec
CODEC_RAW: Codec
KV_POLICY_UNSPECIFIED: KvPolicy
KV_POLICY_PER_LEVEL: KvPolicy
KV_POLICY_CLEAN: KvPolicy
END_REASON_UNSPECIFIED: EndReason
END_REASON_COMPLETED: EndReason
END_REASON_STOPPED: EndReason
END_REASON_INPUT_STALLED: EndReason
INPUT_FORMAT_UNSPECIFIED: InputFormat
INPUT_FORMAT_JPEG: InputFormat
INPUT_FORMAT_RAW: InputFormat
INPUT_PACING_UNSPECIFIED: InputPacing
INPUT_PACING_LIVE: InputPacing
INPUT_PACING_BACKPRESSURE: InputPacing
STREAM_STATE_UNSPECIFIED: StreamState
STREAM_STATE_STARTING: StreamState
STREAM_STATE_STREAMING: StreamState
STREAM_STATE_DRAINING: StreamState
DECODER_UNSPECIFIED: Decoder
DECODER_FULL: Decoder
DECODER_TINY: Decoder
STEPS_PREFERENCE_UNSPECIFIED: StepsPreference
STEPS_PREFERENCE_STEPS_FIRST: StepsPreference
STEPS_PREFERENCE_LATENCY_FIRST: StepsPreference
TRANSITION_UNSPECIFIED: Transition
TRANSITION_CUT: Transition
TRANSITION_RECACHE: Transition

class StreamConfig(_message.Message):
    __slots__ = ("prompt", "width", "height", "chunk_frames", "steps", "seed", "guidance_scale", "codec", "target_fps", "seconds", "policy", "window", "sink", "quality", "timesteps", "shift", "strength", "input_pacing", "input_timeout", "image", "pace", "min_steps", "max_steps", "steps_preference", "negative_prompt", "decoder")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FRAMES_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    GUIDANCE_SCALE_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    TARGET_FPS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    SINK_FIELD_NUMBER: _ClassVar[int]
    QUALITY_FIELD_NUMBER: _ClassVar[int]
    TIMESTEPS_FIELD_NUMBER: _ClassVar[int]
    SHIFT_FIELD_NUMBER: _ClassVar[int]
    STRENGTH_FIELD_NUMBER: _ClassVar[int]
    INPUT_PACING_FIELD_NUMBER: _ClassVar[int]
    INPUT_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    PACE_FIELD_NUMBER: _ClassVar[int]
    MIN_STEPS_FIELD_NUMBER: _ClassVar[int]
    MAX_STEPS_FIELD_NUMBER: _ClassVar[int]
    STEPS_PREFERENCE_FIELD_NUMBER: _ClassVar[int]
    NEGATIVE_PROMPT_FIELD_NUMBER: _ClassVar[int]
    DECODER_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    width: int
    height: int
    chunk_frames: int
    steps: int
    seed: int
    guidance_scale: float
    codec: Codec
    target_fps: float
    seconds: float
    policy: KvPolicy
    window: int
    sink: int
    quality: int
    timesteps: _containers.RepeatedScalarFieldContainer[float]
    shift: float
    strength: float
    input_pacing: InputPacing
    input_timeout: float
    image: bytes
    pace: bool
    min_steps: int
    max_steps: int
    steps_preference: StepsPreference
    negative_prompt: str
    decoder: Decoder
    def __init__(self, prompt: _Optional[str] = ..., width: _Optional[int] = ..., height: _Optional[int] = ..., chunk_frames: _Optional[int] = ..., steps: _Optional[int] = ..., seed: _Optional[int] = ..., guidance_scale: _Optional[float] = ..., codec: _Optional[_Union[Codec, str]] = ..., target_fps: _Optional[float] = ..., seconds: _Optional[float] = ..., policy: _Optional[_Union[KvPolicy, str]] = ..., window: _Optional[int] = ..., sink: _Optional[int] = ..., quality: _Optional[int] = ..., timesteps: _Optional[_Iterable[float]] = ..., shift: _Optional[float] = ..., strength: _Optional[float] = ..., input_pacing: _Optional[_Union[InputPacing, str]] = ..., input_timeout: _Optional[float] = ..., image: _Optional[bytes] = ..., pace: _Optional[bool] = ..., min_steps: _Optional[int] = ..., max_steps: _Optional[int] = ..., steps_preference: _Optional[_Union[StepsPreference, str]] = ..., negative_prompt: _Optional[str] = ..., decoder: _Optional[_Union[Decoder, str]] = ...) -> None: ...

class InputFrame(_message.Message):
    __slots__ = ("data", "format", "pts")
    DATA_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    PTS_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    format: InputFormat
    pts: float
    def __init__(self, data: _Optional[bytes] = ..., format: _Optional[_Union[InputFormat, str]] = ..., pts: _Optional[float] = ...) -> None: ...

class PromptUpdate(_message.Message):
    __slots__ = ("prompt", "transition")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    TRANSITION_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    transition: Transition
    def __init__(self, prompt: _Optional[str] = ..., transition: _Optional[_Union[Transition, str]] = ...) -> None: ...

class Stop(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ClientMessage(_message.Message):
    __slots__ = ("config", "prompt", "stop", "frame")
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    FRAME_FIELD_NUMBER: _ClassVar[int]
    config: StreamConfig
    prompt: PromptUpdate
    stop: Stop
    frame: InputFrame
    def __init__(self, config: _Optional[_Union[StreamConfig, _Mapping]] = ..., prompt: _Optional[_Union[PromptUpdate, _Mapping]] = ..., stop: _Optional[_Union[Stop, _Mapping]] = ..., frame: _Optional[_Union[InputFrame, _Mapping]] = ...) -> None: ...

class Started(_message.Message):
    __slots__ = ("stream_id", "config", "total_frames", "num_chunks", "latent_width", "latent_height", "pipeline_stream_id", "prompt_ms", "opened_ms", "pipeline")
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FRAMES_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    LATENT_WIDTH_FIELD_NUMBER: _ClassVar[int]
    LATENT_HEIGHT_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_MS_FIELD_NUMBER: _ClassVar[int]
    OPENED_MS_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_FIELD_NUMBER: _ClassVar[int]
    stream_id: str
    config: StreamConfig
    total_frames: int
    num_chunks: int
    latent_width: int
    latent_height: int
    pipeline_stream_id: int
    prompt_ms: float
    opened_ms: float
    pipeline: str
    def __init__(self, stream_id: _Optional[str] = ..., config: _Optional[_Union[StreamConfig, _Mapping]] = ..., total_frames: _Optional[int] = ..., num_chunks: _Optional[int] = ..., latent_width: _Optional[int] = ..., latent_height: _Optional[int] = ..., pipeline_stream_id: _Optional[int] = ..., prompt_ms: _Optional[float] = ..., opened_ms: _Optional[float] = ..., pipeline: _Optional[str] = ...) -> None: ...

class Frame(_message.Message):
    __slots__ = ("data", "codec", "index", "pts", "chunk", "latents_ms", "decoded_ms", "encoded_ms", "width", "height", "input_ms", "steps")
    DATA_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    PTS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    LATENTS_MS_FIELD_NUMBER: _ClassVar[int]
    DECODED_MS_FIELD_NUMBER: _ClassVar[int]
    ENCODED_MS_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    INPUT_MS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    codec: Codec
    index: int
    pts: float
    chunk: int
    latents_ms: float
    decoded_ms: float
    encoded_ms: float
    width: int
    height: int
    input_ms: float
    steps: int
    def __init__(self, data: _Optional[bytes] = ..., codec: _Optional[_Union[Codec, str]] = ..., index: _Optional[int] = ..., pts: _Optional[float] = ..., chunk: _Optional[int] = ..., latents_ms: _Optional[float] = ..., decoded_ms: _Optional[float] = ..., encoded_ms: _Optional[float] = ..., width: _Optional[int] = ..., height: _Optional[int] = ..., input_ms: _Optional[float] = ..., steps: _Optional[int] = ...) -> None: ...

class PromptUpdated(_message.Message):
    __slots__ = ("prompt",)
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    def __init__(self, prompt: _Optional[str] = ...) -> None: ...

class End(_message.Message):
    __slots__ = ("reason", "frames", "trailer", "input_frames_dropped")
    REASON_FIELD_NUMBER: _ClassVar[int]
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    TRAILER_FIELD_NUMBER: _ClassVar[int]
    INPUT_FRAMES_DROPPED_FIELD_NUMBER: _ClassVar[int]
    reason: EndReason
    frames: int
    trailer: bytes
    input_frames_dropped: int
    def __init__(self, reason: _Optional[_Union[EndReason, str]] = ..., frames: _Optional[int] = ..., trailer: _Optional[bytes] = ..., input_frames_dropped: _Optional[int] = ...) -> None: ...

class ServerMessage(_message.Message):
    __slots__ = ("started", "frame", "prompt_updated", "end")
    STARTED_FIELD_NUMBER: _ClassVar[int]
    FRAME_FIELD_NUMBER: _ClassVar[int]
    PROMPT_UPDATED_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    started: Started
    frame: Frame
    prompt_updated: PromptUpdated
    end: End
    def __init__(self, started: _Optional[_Union[Started, _Mapping]] = ..., frame: _Optional[_Union[Frame, _Mapping]] = ..., prompt_updated: _Optional[_Union[PromptUpdated, _Mapping]] = ..., end: _Optional[_Union[End, _Mapping]] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StreamStatus(_message.Message):
    __slots__ = ("stream_id", "pipeline_stream_id", "state", "frames_sent", "chunks_received", "vae_state_bytes", "queued_chunks", "queued_messages", "input_frames_received", "input_frames_dropped", "steps", "paced")
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    FRAMES_SENT_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    VAE_STATE_BYTES_FIELD_NUMBER: _ClassVar[int]
    QUEUED_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_MESSAGES_FIELD_NUMBER: _ClassVar[int]
    INPUT_FRAMES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    INPUT_FRAMES_DROPPED_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    PACED_FIELD_NUMBER: _ClassVar[int]
    stream_id: str
    pipeline_stream_id: int
    state: StreamState
    frames_sent: int
    chunks_received: int
    vae_state_bytes: int
    queued_chunks: int
    queued_messages: int
    input_frames_received: int
    input_frames_dropped: int
    steps: int
    paced: bool
    def __init__(self, stream_id: _Optional[str] = ..., pipeline_stream_id: _Optional[int] = ..., state: _Optional[_Union[StreamState, str]] = ..., frames_sent: _Optional[int] = ..., chunks_received: _Optional[int] = ..., vae_state_bytes: _Optional[int] = ..., queued_chunks: _Optional[int] = ..., queued_messages: _Optional[int] = ..., input_frames_received: _Optional[int] = ..., input_frames_dropped: _Optional[int] = ..., steps: _Optional[int] = ..., paced: _Optional[bool] = ...) -> None: ...

class Capacity(_message.Message):
    __slots__ = ("steps", "streams")
    STEPS_FIELD_NUMBER: _ClassVar[int]
    STREAMS_FIELD_NUMBER: _ClassVar[int]
    steps: int
    streams: float
    def __init__(self, steps: _Optional[int] = ..., streams: _Optional[float] = ...) -> None: ...

class CostBudget(_message.Message):
    __slots__ = ("max_frame_pixels", "max_stream_cost", "min_fps", "default_width", "default_height", "default_fps", "default_steps", "default_passes")
    MAX_FRAME_PIXELS_FIELD_NUMBER: _ClassVar[int]
    MAX_STREAM_COST_FIELD_NUMBER: _ClassVar[int]
    MIN_FPS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_WIDTH_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_HEIGHT_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_FPS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_STEPS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_PASSES_FIELD_NUMBER: _ClassVar[int]
    max_frame_pixels: int
    max_stream_cost: float
    min_fps: float
    default_width: int
    default_height: int
    default_fps: float
    default_steps: int
    default_passes: int
    def __init__(self, max_frame_pixels: _Optional[int] = ..., max_stream_cost: _Optional[float] = ..., min_fps: _Optional[float] = ..., default_width: _Optional[int] = ..., default_height: _Optional[int] = ..., default_fps: _Optional[float] = ..., default_steps: _Optional[int] = ..., default_passes: _Optional[int] = ...) -> None: ...

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
    __slots__ = ("process", "steps", "ready", "ready_s")
    PROCESS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    READY_S_FIELD_NUMBER: _ClassVar[int]
    process: str
    steps: _containers.RepeatedCompositeFieldContainer[StartupStep]
    ready: bool
    ready_s: float
    def __init__(self, process: _Optional[str] = ..., steps: _Optional[_Iterable[_Union[StartupStep, _Mapping]]] = ..., ready: _Optional[bool] = ..., ready_s: _Optional[float] = ...) -> None: ...

class GatewayStatus(_message.Message):
    __slots__ = ("active_streams", "max_streams", "vae_state_bytes", "streams", "streams_started", "streams_finished", "ended_by_reason", "coordinator", "waiting_calls", "capacity", "cost_budget", "paced_streams", "unpaced_streams", "pipeline", "slots_free", "slots_total", "draining", "startup", "starting")
    class EndedByReasonEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    ACTIVE_STREAMS_FIELD_NUMBER: _ClassVar[int]
    MAX_STREAMS_FIELD_NUMBER: _ClassVar[int]
    VAE_STATE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STREAMS_FIELD_NUMBER: _ClassVar[int]
    STREAMS_STARTED_FIELD_NUMBER: _ClassVar[int]
    STREAMS_FINISHED_FIELD_NUMBER: _ClassVar[int]
    ENDED_BY_REASON_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_FIELD_NUMBER: _ClassVar[int]
    WAITING_CALLS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    COST_BUDGET_FIELD_NUMBER: _ClassVar[int]
    PACED_STREAMS_FIELD_NUMBER: _ClassVar[int]
    UNPACED_STREAMS_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FREE_FIELD_NUMBER: _ClassVar[int]
    SLOTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    STARTUP_FIELD_NUMBER: _ClassVar[int]
    STARTING_FIELD_NUMBER: _ClassVar[int]
    active_streams: int
    max_streams: int
    vae_state_bytes: int
    streams: _containers.RepeatedCompositeFieldContainer[StreamStatus]
    streams_started: int
    streams_finished: int
    ended_by_reason: _containers.ScalarMap[str, int]
    coordinator: str
    waiting_calls: int
    capacity: _containers.RepeatedCompositeFieldContainer[Capacity]
    cost_budget: CostBudget
    paced_streams: int
    unpaced_streams: int
    pipeline: str
    slots_free: int
    slots_total: int
    draining: bool
    startup: _containers.RepeatedCompositeFieldContainer[StartupProgress]
    starting: bool
    def __init__(self, active_streams: _Optional[int] = ..., max_streams: _Optional[int] = ..., vae_state_bytes: _Optional[int] = ..., streams: _Optional[_Iterable[_Union[StreamStatus, _Mapping]]] = ..., streams_started: _Optional[int] = ..., streams_finished: _Optional[int] = ..., ended_by_reason: _Optional[_Mapping[str, int]] = ..., coordinator: _Optional[str] = ..., waiting_calls: _Optional[int] = ..., capacity: _Optional[_Iterable[_Union[Capacity, _Mapping]]] = ..., cost_budget: _Optional[_Union[CostBudget, _Mapping]] = ..., paced_streams: _Optional[int] = ..., unpaced_streams: _Optional[int] = ..., pipeline: _Optional[str] = ..., slots_free: _Optional[int] = ..., slots_total: _Optional[int] = ..., draining: _Optional[bool] = ..., startup: _Optional[_Iterable[_Union[StartupProgress, _Mapping]]] = ..., starting: _Optional[bool] = ...) -> None: ...
