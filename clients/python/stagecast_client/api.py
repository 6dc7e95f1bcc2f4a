"""The public API's enums (``stagecast.v1``) and the names the SDK, the gateway and the CLI use for them.

Usage::

    from stagecast_client import api
    api.codec_value("h264")                 # pb.CODEC_H264; raises ValueError naming ``codec`` for an unknown name
    api.codec_name(pb.CODEC_H264)           # "h264"; api.codec_name(pb.CODEC_UNSPECIFIED) -> "jpeg" (the default)
    api.policy_value("clean"), api.policy_name(pb.KV_POLICY_CLEAN)
    api.end_reason_name(pb.END_REASON_STOPPED)       # "stopped"
    api.state_value("draining"), api.state_name(pb.STREAM_STATE_DRAINING)
    api.decoder_value("tiny"), api.decoder_name(pb.DECODER_TINY)   # pb.DECODER_TINY, "tiny"

The wire carries enums (so clients in any language get typed values); Python users keep the short lower-case
names (``codec="jpeg"``), which are also the names the gateway logs, traces and labels metrics with.
"""

from __future__ import annotations

from collections.abc import Mapping

from stagecast_client.v1 import stream_pb2 as pb

CODECS = {"jpeg": pb.CODEC_JPEG, "h264": pb.CODEC_H264, "raw": pb.CODEC_RAW}
POLICIES = {"per_level": pb.KV_POLICY_PER_LEVEL, "clean": pb.KV_POLICY_CLEAN}
END_REASONS = {
    "completed": pb.END_REASON_COMPLETED,
    "stopped": pb.END_REASON_STOPPED,
    "input_stalled": pb.END_REASON_INPUT_STALLED,
}
INPUT_FORMATS = {"jpeg": pb.INPUT_FORMAT_JPEG, "raw": pb.INPUT_FORMAT_RAW}
INPUT_PACINGS = {"live": pb.INPUT_PACING_LIVE, "backpressure": pb.INPUT_PACING_BACKPRESSURE}
DEFAULT_INPUT_PACING = "live"
STATES = {
    "starting": pb.STREAM_STATE_STARTING,
    "streaming": pb.STREAM_STATE_STREAMING,
    "draining": pb.STREAM_STATE_DRAINING,
}
STEPS_PREFERENCES = {
    "steps_first": pb.STEPS_PREFERENCE_STEPS_FIRST,
    "latency_first": pb.STEPS_PREFERENCE_LATENCY_FIRST,
}
DEFAULT_STEPS_PREFERENCE = "steps_first"
DECODERS = {"full": pb.DECODER_FULL, "tiny": pb.DECODER_TINY}
DEFAULT_DECODER = "full"  # the model's own VAE, exact; a deployment may make "tiny" its default
DEFAULT_CODEC = "jpeg"
DEFAULT_POLICY = "per_level"
# The frame rate a stream runs at when neither the request (``target_fps``) nor the checkpoint's ``stagecast.json``
# (``serving.fps``) sets one: Wan 2.1 generates 16 fps video.  The gateway's serving default, the SDK's input clock,
# the encoders, the demo checkpoint, the simulator and the benchmarks use it.  No Helm value mirrors it (the rate
# comes from the checkpoint); tests/test_one_home.py checks the chart still sets none, or sets this one.
DEFAULT_FPS = 16.0
# What a checkpoint without ``stagecast.json`` serves a request that sets nothing (the gateway's ServingDefaults), and
# what the coordinator prices a free slot at (coordinator.slots.StreamDefaults): Wan's 832x480, 4 steps, one latent
# frame per chunk, and the 512 text tokens the Wan models were trained with.
DEFAULT_WIDTH = 832
DEFAULT_HEIGHT = 480
DEFAULT_STEPS = 4
DEFAULT_CHUNK_FRAMES = 1
DEFAULT_TEXT_LEN = 512
# The public API's prompt (and negative prompt) limit in characters: tokenising is the real limit; this stops
# absurd payloads before it runs.
MAX_PROMPT_CHARS = 20_000
# The largest legal request other than an input frame: a config whose prompt and negative prompt are
# MAX_PROMPT_CHARS characters of 4 UTF-8 bytes each, plus the other fields (under 400 bytes, a 50-step ladder
# included) and framing.  The gateway refuses bigger messages before parsing them, and the web edge bounds a
# browser's control message by it (so it passes on every request the gateway would take, and no bigger one).
MAX_REQUEST_BYTES = 2 * 4 * MAX_PROMPT_CHARS + 16 * 1024


def _value(field: str, table: Mapping[str, int], value: str | int | None, default: str | None) -> int:
    if value is None or value == "":
        return table[default] if default is not None else 0
    if isinstance(value, str):
        if value.lower() in table:
            return table[value.lower()]
        raise ValueError(f"{field}: must be one of {', '.join(table)}, got {value!r}")
    return int(value)  # an enum number: passed through, the gateway checks it


def _name(field: str, table: Mapping[str, int], value: int, default: str | None) -> str:
    if value == 0 and default is not None:
        return default
    for name, number in table.items():
        if number == value:
            return name
    raise ValueError(f"{field}: unknown value {value}")


def codec_value(name: str | int | None) -> pb.Codec:
    """The wire value of a codec name (``None`` or ``""``: the default, JPEG)."""
    return _value("codec", CODECS, name, DEFAULT_CODEC)  # type: ignore[return-value]  # an enum number


def codec_name(value: int) -> str:
    return _name("codec", CODECS, value, DEFAULT_CODEC)


def policy_value(name: str | int | None) -> pb.KvPolicy:
    """The wire value of a KV policy name; ``None`` or ``""`` stay UNSPECIFIED (the gateway's default)."""
    return _value("policy", POLICIES, name, None)  # type: ignore[return-value]  # an enum number


def policy_name(value: int) -> str:
    return _name("policy", POLICIES, value, DEFAULT_POLICY)


def input_format_value(name: str | int | None) -> pb.InputFormat:
    """The wire value of an input frame format name (``"jpeg"`` or ``"raw"``)."""
    return _value("format", INPUT_FORMATS, name, None)  # type: ignore[return-value]


def input_pacing_value(name: str | int | None) -> pb.InputPacing:
    """The wire value of an input pacing name; ``None`` or ``""`` stay UNSPECIFIED (LIVE)."""
    return _value("input_pacing", INPUT_PACINGS, name, None)  # type: ignore[return-value]


def input_pacing_name(value: int) -> str:
    return _name("input_pacing", INPUT_PACINGS, value, DEFAULT_INPUT_PACING)


def steps_preference_value(name: str | int | None) -> pb.StepsPreference:
    """The wire value of a steps preference ("steps_first" | "latency_first"); None stays UNSPECIFIED."""
    return _value("steps_preference", STEPS_PREFERENCES, name, None)  # type: ignore[return-value]


def steps_preference_name(value: int) -> str:
    return _name("steps_preference", STEPS_PREFERENCES, value, DEFAULT_STEPS_PREFERENCE)


def decoder_value(name: str | int | None) -> pb.Decoder:
    """The wire value of a decoder name ("full" | "tiny"); ``None`` or ``""`` stay UNSPECIFIED (the deployment's
    default)."""
    return _value("decoder", DECODERS, name, None)  # type: ignore[return-value]


def decoder_name(value: int, default: str = DEFAULT_DECODER) -> str:
    return _name("decoder", DECODERS, value, default)


def end_reason_value(name: str) -> int:
    return _value("reason", END_REASONS, name, None)


def end_reason_name(value: int) -> str:
    return _name("reason", END_REASONS, value, None) if value else "unspecified"


def state_value(name: str) -> int:
    return _value("state", STATES, name, None)


def state_name(value: int) -> str:
    return _name("state", STATES, value, None) if value else "unspecified"
