"""The web edge's control-message schema and the MSE type of an fMP4 stream, in process: what the data channel and
the WebSocket accept, and the field each refusal names."""

from __future__ import annotations

import json

import numpy as np
import pytest

from stagecast.media import make_encoder
from web.control import MAX_MESSAGE_BYTES, BadMessage, parse_message
from web.fallback import mse_mime

pytestmark = pytest.mark.unit


def test_the_four_kinds_parse_into_sdk_arguments():
    msg = parse_message(json.dumps({"type": "config", "prompt": "a fox", "steps": 2, "target_fps": 16, "seed": 7}))
    assert msg.kind == "config" and msg.config == {"prompt": "a fox", "steps": 2, "target_fps": 16, "seed": 7}
    assert parse_message('{"type": "prompt", "prompt": "a bird"}').prompt == "a bird"
    assert parse_message(b'{"type": "stop"}').kind == "stop"
    assert parse_message('{"type": "ping"}').kind == "ping"
    ws = parse_message(json.dumps({"type": "config", "prompt": "x", "token": "t" * 20, "strength": 500}))
    assert ws.token == "t" * 20 and ws.config == {"prompt": "x", "strength": 500}  # the token is not a config field
    cfg = parse_message(json.dumps({"type": "config", "prompt": "x", "guidance_scale": 3, "negative_prompt": "blur"}))
    assert cfg.config == {"prompt": "x", "guidance_scale": 3, "negative_prompt": "blur"}
    for decoder in ("tiny", "full"):  # the SDK's decoder= names
        assert (
            parse_message(json.dumps({"type": "config", "prompt": "x", "decoder": decoder})).config["decoder"]
            == decoder
        )


@pytest.mark.parametrize(
    "data, field",
    [
        ("{", "message"),
        (b"\xff\xfe", "message"),
        ("[]", "message"),
        ('{"type": 3}', "type"),
        ('{"type": "config"}', "prompt"),
        ('{"type": "config", "prompt": "x", "width": true}', "width"),  # a JSON boolean is not a number
        ('{"type": "config", "prompt": "x", "width": 64.5}', "width"),
        ('{"type": "config", "prompt": "x", "codec": "h264"}', "codec"),  # the web process picks the codec
        ('{"type": "config", "prompt": "x", "timesteps": [700, "500"]}', "timesteps[1]"),
        ('{"type": "config", "prompt": "x", "decoder": "DECODER_TINY"}', "decoder"),  # the names, not the enum's
        ('{"type": "config", "prompt": "x", "decoder": 2}', "decoder"),
        ('{"type": "prompt"}', "prompt"),
        ('{"type": "prompt", "prompt": ["a"]}', "prompt"),
        ('{"type": "stop", "now": true}', "now"),
        ('{"type": "ping", "token": 5}', "token"),
        ("[" * 40_000 + "]" * 40_000, "message"),  # under the size, deeper than the JSON parser's recursion limit
        ('{"type": "prompt", "prompt": "' + "x" * MAX_MESSAGE_BYTES + '"}', "message"),
    ],
)
def test_junk_is_refused_naming_the_field(data, field):
    with pytest.raises(BadMessage) as info:
        parse_message(data)
    assert str(info.value).split(":")[0] == field, str(info.value)


def test_the_mse_type_names_the_streams_h264_profile_and_level():
    enc = make_encoder("h264", width=64, height=64, fps=16)
    data = enc.encode(np.zeros((64, 64, 3), np.uint8), keyframe=True) + enc.flush()
    mime = mse_mime(data)
    assert mime.startswith('video/mp4; codecs="avc1.') and len(mime.split("avc1.")[1].rstrip('"')) == 6
    at = data.find(b"avcC")
    assert mime.split("avc1.")[1].rstrip('"') == data[at + 5 : at + 8].hex().upper()
