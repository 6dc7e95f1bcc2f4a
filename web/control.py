"""Control messages between a browser and the web process: one JSON schema for the data channel and the WebSocket.

Usage::

    msg = parse_message(text)          # -> ControlMessage, or raises BadMessage naming the field
    if msg.kind == "config": gen = client.generate(**msg.config, codec="raw")

From the browser (one JSON object per message, at most ``MAX_MESSAGE_BYTES``):

    {"type": "config", "prompt": "...", "steps": 2, "width": 64, "height": 64, "seed": 0, ...}   # (re)start a stream
    {"type": "prompt", "prompt": "..."}                                                            # PromptUpdate
    {"type": "stop"}                                                                               # graceful Stop
    {"type": "ping"}                                                                               # keep-alive

To the browser: ``started`` (the effective config), ``frame`` (per-frame stats), ``prompt_updated``, ``end``,
``error`` (``{"type": "error", "message": "width: ..."}``).  The fields of ``config`` are the public
``StreamConfig``'s; their ranges are checked by the gateway, in one place, and its errors are passed on as they are.
Here only the shape is checked: the type of every field, and no unknown field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from stagecast.api import MAX_REQUEST_BYTES

# The gateway's own bound on a request (stagecast.api, which the gateway's MAX_REQUEST_BYTES is): every config the
# gateway would take, a 20,000-character prompt and negative prompt included, fits; nothing bigger is read.
MAX_MESSAGE_BYTES = MAX_REQUEST_BYTES

# StreamConfig fields a browser may set, with the JSON type each must have.  The codec is the web process's choice
# (raw frames for WebRTC, H.264 fMP4 for the WebSocket), so it is not among them.
CONFIG_FIELDS: dict[str, tuple[type, ...]] = {
    "prompt": (str,),
    "width": (int,),
    "height": (int,),
    "seconds": (int, float),
    "chunk_frames": (int,),
    "steps": (int,),
    "seed": (int,),
    "target_fps": (int, float),
    "policy": (str,),
    "window": (int,),
    "sink": (int,),
    "quality": (int,),
    "timesteps": (list,),
    # Video-to-video (the webcam): the ladder timestep the input is noised to, and when a silent input ends it.
    "strength": (int, float),
    "input_timeout": (int, float),
    # Classifier-free guidance, for checkpoints that are not guidance-distilled.
    "guidance_scale": (int, float),
    "negative_prompt": (str,),
    "decoder": (str,),  # "full" (the VAE) or "tiny" (where the deployment has one)
}
# Fields whose string must be one of a few names (the SDK's; the gateway checks the rest).
CONFIG_CHOICES: dict[str, tuple[str, ...]] = {"decoder": ("full", "tiny")}
KINDS = ("config", "prompt", "stop", "ping")


class BadMessage(ValueError):
    """A control message that is not one of ours; the text names the field."""


@dataclass(frozen=True)
class ControlMessage:
    kind: str
    config: dict = field(default_factory=dict)  # kind "config": StreamConfig keyword arguments
    prompt: str = ""  # kind "prompt"
    token: str | None = None  # the WebSocket's config carries the bearer token (browsers cannot set its headers)


def _check_type(name: str, value: object, kinds: tuple[type, ...]) -> None:
    # bool is an int in Python; a JSON true is never a number here.
    if isinstance(value, bool) or not isinstance(value, kinds):
        want = " or ".join("number" if k is float else {int: "integer", str: "string", list: "list"}[k] for k in kinds)
        raise BadMessage(f"{name}: must be {want}, got {type(value).__name__}")


def _load(data: str | bytes) -> dict:
    """The message as a JSON object, within its byte limit."""
    if isinstance(data, bytes):
        if len(data) > MAX_MESSAGE_BYTES:
            raise BadMessage(f"message: {len(data)} bytes, the limit is {MAX_MESSAGE_BYTES}")
        try:
            data = data.decode("utf-8")
        except UnicodeDecodeError:
            raise BadMessage("message: not UTF-8 JSON") from None
    if len(data.encode("utf-8", errors="replace")) > MAX_MESSAGE_BYTES:
        raise BadMessage(f"message: over {MAX_MESSAGE_BYTES} bytes")
    try:
        obj = json.loads(data)
    except (ValueError, RecursionError):
        raise BadMessage("message: not JSON") from None
    if not isinstance(obj, dict):
        raise BadMessage("message: must be a JSON object")
    return obj


def _config(obj: dict) -> dict:
    """A config message's StreamConfig fields, each of its type and among its choices."""
    config = {k: v for k, v in obj.items() if k not in ("type", "token")}
    for name, value in config.items():
        if name not in CONFIG_FIELDS:
            raise BadMessage(f"{name[:40]}: not a config field (one of {', '.join(CONFIG_FIELDS)})")
        _check_type(name, value, CONFIG_FIELDS[name])
        if name in CONFIG_CHOICES and value not in CONFIG_CHOICES[name]:
            raise BadMessage(f"{name}: must be one of {', '.join(CONFIG_CHOICES[name])}, got {value[:40]!r}")
    if "prompt" not in config:
        raise BadMessage("prompt: required")
    for i, t in enumerate(config.get("timesteps", ())):
        _check_type(f"timesteps[{i}]", t, (int, float))
    return config


def parse_message(data: str | bytes) -> ControlMessage:
    obj = _load(data)
    kind = obj.get("type")
    if kind not in KINDS:
        raise BadMessage(f"type: must be one of {', '.join(KINDS)}, got {str(kind)[:40]!r}")
    token = obj.get("token")
    if token is not None:
        _check_type("token", token, (str,))
    if kind == "config":
        return ControlMessage("config", config=_config(obj), token=token)
    extra = set(obj) - {"type", "token", "prompt"}
    if extra:
        raise BadMessage(f"{sorted(extra)[0][:40]}: not a field of a {kind} message")
    if kind == "prompt":
        prompt = obj.get("prompt")
        if prompt is None:
            raise BadMessage("prompt: required")
        _check_type("prompt", prompt, (str,))
        return ControlMessage("prompt", prompt=prompt, token=token)
    return ControlMessage(kind, token=token)


def dumps(msg: dict) -> str:
    return json.dumps(msg, separators=(",", ":"))
