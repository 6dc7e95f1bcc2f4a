"""Frame encoders: JPEG and fMP4 decode back to the right frames, raw is exact, bad arguments fail clearly."""

from __future__ import annotations

import io
import struct
from fractions import Fraction

import av
import numpy as np
import pytest
import torch
from PIL import Image

from stagecast.media import (
    CODECS,
    JpegEncoder,
    Mp4Encoder,
    RawEncoder,
    find_h264_encoder,
    make_encoder,
    quality_to_crf,
    raw_to_frames,
    read_mp4_frames,
    write_mp4,
)

pytestmark = pytest.mark.unit

W, H = 64, 48


def smooth_frame(i: int, width: int = W, height: int = H) -> np.ndarray:
    # Smooth gradients that move with i: lossy codecs should reproduce them closely, and frames differ.
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    r = 128 + 100 * np.sin((x + 3 * i) / 10)
    g = 128 + 100 * np.cos((y + 2 * i) / 9)
    b = np.full_like(x, (40 + 15 * i) % 256)
    return np.stack([r, g, b], axis=-1).clip(0, 255).astype(np.uint8)


def mean_abs_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a.astype(np.int16) - b.astype(np.int16)).mean())


def top_level_boxes(data: bytes) -> list[str]:
    """ISO-BMFF box types at the top level; asserts the boxes exactly tile the data."""
    boxes, pos = [], 0
    while pos < len(data):
        size, kind = struct.unpack(">I4s", data[pos : pos + 8])
        assert size >= 8
        boxes.append(kind.decode())
        pos += size
    assert pos == len(data)
    return boxes


# --- jpeg -------------------------------------------------------------------------------------------------------


def test_jpeg_decodes_to_close_frame():
    frame = smooth_frame(0)
    data = JpegEncoder(W, H, quality=95).encode(frame)
    assert data[:2] == b"\xff\xd8"
    img = Image.open(io.BytesIO(data))
    assert img.format == "JPEG" and img.size == (W, H) and img.mode == "RGB"
    assert mean_abs_err(np.asarray(img), frame) < 3


def test_jpeg_quality_and_torch_input():
    frame = smooth_frame(1)
    small = JpegEncoder(quality=10).encode(frame)
    big = JpegEncoder(quality=95).encode(torch.from_numpy(frame))
    assert len(small) < len(big)
    assert mean_abs_err(np.asarray(Image.open(io.BytesIO(small))), frame) < 12


# --- h264 / fragmented mp4 --------------------------------------------------------------------------------------


def test_fmp4_stream_decodes_to_exactly_n_frames():
    n, fps = 20, 16
    frames = [smooth_frame(i) for i in range(n)]
    enc = make_encoder("h264", width=W, height=H, fps=fps)
    assert isinstance(enc, Mp4Encoder)
    chunks = [enc.encode(f) for f in frames]
    chunks.append(enc.flush())

    # The init segment comes with the first frame, and with gop = 1 s a fragment is out before the stream ends.
    assert top_level_boxes(chunks[0]) == ["ftyp", "moov"]
    assert any(chunks[1:-1])
    # Every non-empty chunk is made of whole boxes, so a client can append each one to a MediaSource buffer.
    for chunk in chunks[1:-1]:
        if chunk:
            assert set(top_level_boxes(chunk)) == {"moof", "mdat"}
    boxes = top_level_boxes(b"".join(chunks))
    assert boxes.count("moof") == boxes.count("mdat") == n // fps + 1
    assert "moov" in boxes and boxes.index("moov") < boxes.index("moof")

    data = b"".join(chunks)
    decoded = read_mp4_frames(data)
    assert len(decoded) == n
    for got, want in zip(decoded, frames):
        assert got.shape == (H, W, 3) and got.dtype == np.uint8
        assert mean_abs_err(got, want) < 6
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        assert stream.codec_context.name == "h264"
        assert stream.average_rate == Fraction(fps)


def test_fmp4_fragment_every_frame_lags_one_frame():
    enc = Mp4Encoder(W, H, 24, fragment_every_frame=True)
    chunks = [enc.encode(smooth_frame(i)) for i in range(5)]
    tail = enc.flush()
    assert all(chunks[1:])  # frame i's fragment is written when frame i + 1 arrives
    assert len(read_mp4_frames(b"".join(chunks) + tail)) == 5


def test_encode_after_flush_and_close_are_safe():
    enc = Mp4Encoder(W, H)
    enc.encode(smooth_frame(0))
    assert enc.flush()
    assert enc.flush() == b""
    with pytest.raises(RuntimeError):
        enc.encode(smooth_frame(1))
    abandoned = Mp4Encoder(W, H)
    abandoned.encode(smooth_frame(0))
    abandoned.close()
    abandoned.close()


def test_write_and_read_mp4_file(tmp_path):
    path = tmp_path / "clip.mp4"
    frames = [smooth_frame(i, 32, 32) for i in range(7)]
    assert write_mp4(path, iter(frames), fps=8) == 7
    decoded = read_mp4_frames(path)
    assert len(decoded) == 7
    assert all(mean_abs_err(g, w) < 6 for g, w in zip(decoded, frames))
    assert len(read_mp4_frames(str(path))) == 7
    with pytest.raises(ValueError, match="at least one frame"):
        write_mp4(tmp_path / "empty.mp4", [], fps=8)


def test_h264_encoder_fallback_and_error():
    assert find_h264_encoder(("no_such_encoder_xyz", "libx264")) == "libx264"
    with pytest.raises(RuntimeError, match="no usable H.264 encoder"):
        find_h264_encoder(("no_such_encoder_xyz",))


@pytest.mark.parametrize("width,height", [(63, 48), (64, 47), (33, 33)])
def test_h264_odd_size_is_rejected(width, height):
    with pytest.raises(ValueError, match=rf"even width and height, got {width}x{height}"):
        make_encoder("h264", width=width, height=height, fps=16)


# --- raw ----------------------------------------------------------------------------------------------------------


def test_raw_round_trips_exactly():
    rng = np.random.default_rng(0)
    frames = rng.integers(0, 256, size=(3, 5, 7, 3), dtype=np.uint8)  # odd sizes are fine for raw
    enc = make_encoder("raw", width=7, height=5, fps=16)
    assert isinstance(enc, RawEncoder)
    data = b"".join(enc.encode(f) for f in frames) + enc.flush()
    assert len(data) == 3 * 5 * 7 * 3
    np.testing.assert_array_equal(raw_to_frames(data, 7, 5), frames)
    assert enc.encode(torch.from_numpy(frames[0])) == frames[0].tobytes()
    with pytest.raises(ValueError, match="whole number"):
        raw_to_frames(data[:-1], 7, 5)


# --- validation ---------------------------------------------------------------------------------------------------


def test_unknown_codec_names_field_and_choices():
    with pytest.raises(ValueError, match=r"^codec must be one of jpeg, h264, raw; got 'vp9'"):
        make_encoder("vp9", width=W, height=H, fps=16)
    assert CODECS == ("jpeg", "h264", "raw")


@pytest.mark.parametrize("codec", CODECS)
def test_bad_frames_name_field(codec):
    enc = make_encoder(codec, width=W, height=H, fps=16)
    with pytest.raises(ValueError, match=r"^frame is 32x48 but the encoder was opened for 64x48"):
        enc.encode(np.zeros((H, 32, 3), np.uint8))
    with pytest.raises(ValueError, match=r"^frame must be uint8"):
        enc.encode(np.zeros((H, W, 3), np.float32))
    with pytest.raises(ValueError, match=r"^frame must have shape \(H, W, 3\)"):
        enc.encode(np.zeros((H, W, 4), np.uint8))
    with pytest.raises(ValueError, match=r"^frame must be a numpy array"):
        enc.encode([[0, 0, 0]])
    enc.close()


@pytest.mark.parametrize("codec", CODECS)
def test_bad_quality_and_fps(codec):
    with pytest.raises(ValueError, match=r"^quality must be"):
        make_encoder(codec, width=W, height=H, fps=16, quality=0)
    with pytest.raises(ValueError, match=r"^fps must be > 0"):
        make_encoder(codec, width=W, height=H, fps=0)


def test_quality_to_crf():
    assert quality_to_crf(100) == 0
    assert quality_to_crf(1) == 50
    assert quality_to_crf(55) == 23


def test_chunked_h264_cuts_one_fragment_per_chunk_and_a_chunk_plays_once_the_next_starts():
    # Chunks as the gateway makes them: 1 frame, then 4 per chunk; each chunk's first frame is marked keyframe.
    rng = np.random.default_rng(3)
    chunks = [[rng.integers(0, 255, (48, 64, 3), dtype=np.uint8)]]
    chunks += [[rng.integers(0, 255, (48, 64, 3), dtype=np.uint8) for _ in range(4)] for _ in range(3)]
    enc = make_encoder("h264", width=64, height=48, fps=16, chunked=True)
    data = b""
    for c, chunk in enumerate(chunks):
        for position, frame in enumerate(chunk):
            data += enc.encode(frame, keyframe=position == 0)
            if position == 0:
                # The chunk starting here wrote out every earlier chunk, one fragment each, and nothing more.
                assert data.count(b"moof") == c
                assert len(read_mp4_frames(data)) == sum(len(ch) for ch in chunks[:c])
    data += enc.flush()
    assert data.count(b"moof") == len(chunks)
    assert len(read_mp4_frames(data)) == sum(len(ch) for ch in chunks)
    # Without chunk keyframes the first fragment waits for the GOP (16 frames at 16 fps): nothing plays yet.
    plain = make_encoder("h264", width=64, height=48, fps=16)
    data = b"".join(plain.encode(frame) for chunk in chunks for frame in chunk)
    assert b"moof" not in data
