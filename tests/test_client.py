"""The client SDK's offline pieces: config building, error mapping, frame decoding and the MP4 helper."""

import grpc
import numpy as np
import pytest

import stagecast
from stagecast.client import stream_config
from stagecast.errors import from_rpc_error
from stagecast.frames import Frame, FrameTiming, save_mp4
from stagecast.media import JpegEncoder, Mp4Encoder, read_mp4_frames
from stagecast.v1 import stream_pb2 as pb

pytestmark = pytest.mark.unit

TIMING = FrameTiming(0.0, 0.0, 0.0, 0.0)


def frames(n, w=32, h=16):
    rng = np.random.default_rng(0)
    return [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for _ in range(n)]


def test_stream_config_leaves_out_what_the_caller_did_not_set():
    msg = stream_config("a cat", width=64, seconds=2)
    assert msg.HasField("width") and msg.HasField("seconds") and msg.seconds == 2
    assert not msg.HasField("height") and not msg.HasField("seed") and not msg.HasField("steps")
    assert msg.codec == pb.CODEC_JPEG  # the SDK keeps the names; the wire carries the enum
    assert stream_config("a cat", seed=0).HasField("seed")  # an explicit 0 is a value, not "absent"


class FakeRpcError(grpc.RpcError):
    def __init__(self, code, details):
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


@pytest.mark.parametrize(
    "code,cls",
    [
        (grpc.StatusCode.INVALID_ARGUMENT, stagecast.InvalidArgumentError),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, stagecast.ResourceExhaustedError),
        (grpc.StatusCode.UNAVAILABLE, stagecast.UnavailableError),
        (grpc.StatusCode.CANCELLED, stagecast.CancelledError),
        (grpc.StatusCode.DEADLINE_EXCEEDED, stagecast.DeadlineExceededError),
        (grpc.StatusCode.INTERNAL, stagecast.InternalError),
    ],
)
def test_every_status_code_has_its_own_exception_class(code, cls):
    err = from_rpc_error(FakeRpcError(code, "width: bad"))
    assert type(err) is cls and isinstance(err, stagecast.StagecastError)
    assert err.code == code and err.details == "width: bad" and str(err) == f"{code.name}: width: bad"


def test_raw_and_jpeg_frames_decode_to_arrays():
    (img,) = frames(1)
    raw = Frame(0, 0.0, 0, "raw", img.tobytes(), 32, 16, TIMING)
    assert np.array_equal(raw.to_array(), img)
    jpeg = Frame(0, 0.0, 0, "jpeg", JpegEncoder(32, 16).encode(img), 32, 16, TIMING)
    assert jpeg.to_array().shape == (16, 32, 3)
    with pytest.raises(ValueError, match="h264"):
        Frame(0, 0.0, 0, "h264", b"", 32, 16, TIMING).to_array()


def test_save_mp4_reencodes_raw_frames_and_concatenates_h264_fragments(tmp_path):
    imgs = frames(7)
    raw = [Frame(i, i / 16, 0, "raw", f.tobytes(), 32, 16, TIMING) for i, f in enumerate(imgs)]
    assert save_mp4(raw, tmp_path / "raw.mp4", fps=16) == 7
    assert [f.shape for f in read_mp4_frames(tmp_path / "raw.mp4")] == [(16, 32, 3)] * 7

    enc = Mp4Encoder(32, 16, 16)
    h264 = [Frame(i, i / 16, 0, "h264", enc.encode(f), 32, 16, TIMING) for i, f in enumerate(imgs)]
    assert save_mp4(h264, tmp_path / "h264.mp4", fps=16, trailer=enc.flush()) == 7
    assert len(read_mp4_frames(tmp_path / "h264.mp4")) == 7


def test_the_sdk_is_exported_from_the_package():
    for name in ("Client", "AsyncClient", "Frame", "StagecastError", "InvalidArgumentError", "ResourceExhaustedError"):
        assert name in stagecast.__all__ and getattr(stagecast, name)


def test_the_server_names_are_the_client_distributions_modules_and_stream_proto_is_registered_once():
    import sys

    import stagecast.v1.stream_pb2
    import stagecast_client
    import stagecast_client.client
    from google.protobuf import descriptor_pool
    from stagecast_client.errors import retry_after_of as client_retry_after_of
    from stagecast_client.v1 import stream_pb2 as client_pb

    import stagecast.client
    from stagecast.grpc_util import retry_after_of
    from stagecast.v1 import stream_pb2 as server_pb

    assert server_pb is client_pb is stagecast.v1.stream_pb2 and stagecast.v1 is sys.modules["stagecast_client.v1"]
    assert server_pb.StreamConfig is client_pb.StreamConfig and client_pb.__name__ == "stagecast_client.v1.stream_pb2"
    assert stagecast.client is stagecast_client.client and stagecast.Client is stagecast_client.Client
    assert stagecast.InvalidArgumentError is stagecast_client.InvalidArgumentError
    assert retry_after_of is client_retry_after_of  # one reading of a refusal's RetryInfo
    # One generated module holds stream.proto, however many names it is imported under.
    holders = {
        id(m)
        for name, m in list(sys.modules.items())
        if name.endswith("_pb2")
        and getattr(getattr(m, "DESCRIPTOR", None), "name", None) == "stagecast/v1/stream.proto"
    }
    assert len(holders) == 1
    assert descriptor_pool.Default().FindFileByName("stagecast/v1/stream.proto") is client_pb.DESCRIPTOR
    assert sorted(stagecast.__all__) == sorted(stagecast_client.__all__)


def test_an_unknown_input_format_is_refused_naming_the_field_before_any_call():
    from stagecast.client import Transform
    from stagecast.v1 import stream_pb2

    with pytest.raises(ValueError, match="input_format: must be jpeg or raw, got 'png'"):
        Transform(None, stream_pb2.StreamConfig(), [], input_format="png")  # no stub needed: refused first
