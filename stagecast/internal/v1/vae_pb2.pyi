from stagecast.internal.v1 import pipeline_pb2 as _pipeline_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class VAEChunk(_message.Message):
    __slots__ = ("chunk", "data")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    chunk: int
    data: _pipeline_pb2.Tensor
    def __init__(self, chunk: _Optional[int] = ..., data: _Optional[_Union[_pipeline_pb2.Tensor, _Mapping]] = ...) -> None: ...

class VAEStageDescription(_message.Message):
    __slots__ = ("index", "num_slices", "unit_start", "unit_stop", "next", "open_streams", "state_bytes", "device")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_SLICES_FIELD_NUMBER: _ClassVar[int]
    UNIT_START_FIELD_NUMBER: _ClassVar[int]
    UNIT_STOP_FIELD_NUMBER: _ClassVar[int]
    NEXT_FIELD_NUMBER: _ClassVar[int]
    OPEN_STREAMS_FIELD_NUMBER: _ClassVar[int]
    STATE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    index: int
    num_slices: int
    unit_start: int
    unit_stop: int
    next: str
    open_streams: int
    state_bytes: int
    device: str
    def __init__(self, index: _Optional[int] = ..., num_slices: _Optional[int] = ..., unit_start: _Optional[int] = ..., unit_stop: _Optional[int] = ..., next: _Optional[str] = ..., open_streams: _Optional[int] = ..., state_bytes: _Optional[int] = ..., device: _Optional[str] = ...) -> None: ...
