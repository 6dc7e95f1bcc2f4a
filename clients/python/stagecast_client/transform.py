"""``stagecast transform``: restyle a video file through a gateway (video-to-video) into an MP4, with a progress bar,
TTFF and FPS.

Usage::

    stagecast transform --target localhost:50051 --input in.mp4 --prompt "a watercolor painting" --out out.mp4
    report = transform_clip("localhost:50051", "in.mp4", "out.mp4", prompt="...", strength=700, steps=2)
    report.frames, report.ttff, report.fps

The input is decoded with PyAV and sent as fast as the gateway takes it (``input_pacing="backpressure"``: nothing is
dropped, gRPC flow control holds the sender back); output frame i is made from input frame i.  ``--strength`` is the
ladder timestep the input is noised to; by default the first timestep that keeps some of the input
(``default_strength``: the ladder's second when its first is pure noise, 1000, as in [1000, 750, 500, 250] -> 750;
else its first, as in [700, 500, 400, 200] -> 700).  TTFF is measured from sending the config to receiving the
first frame; FPS over the frames after the first.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

from tqdm import tqdm

from stagecast_client.cli import INTERRUPTED
from stagecast_client.client import Client
from stagecast_client.generate import add_decoder_flag, ladder_arg, token_from
from stagecast_client.helpformat import HelpFormatter
from stagecast_client.media import video_info


@dataclass
class TransformReport:
    out: str
    frames_in: int
    frames: int
    width: int
    height: int
    strength: float
    end_reason: str
    ttff: float | None
    fps: float | None
    seed: int = 0
    timesteps: tuple[float, ...] = ()  # the stream's ladder; strength is one of them

    def summary(self) -> str:
        ttff = f"{self.ttff:.3f} s" if self.ttff is not None else "n/a"
        fps = f"{self.fps:.1f}" if self.fps is not None else "n/a"
        ladder = ", ".join(f"{t:g}" for t in self.timesteps)
        # Stop is how the input's end reaches the gateway: a clip restyled to its last frame ended as asked.
        done = self.end_reason == "stopped" and self.frames == self.frames_in
        end = "to the input's end" if done else self.end_reason
        return (
            f"wrote {self.out}: {self.frames} of {self.frames_in} input frames restyled, {self.width}x{self.height} "
            f"(seed {self.seed}, strength {self.strength:g} on timesteps [{ladder}], {end}); TTFF {ttff}; FPS {fps}"
        )


def transform_clip(
    target: str,
    source: str | os.PathLike,
    out: str | os.PathLike,
    *,
    prompt: str,
    strength: float | None = None,
    progress: bool = True,
    timeout: float | None = None,
    token: str | None = None,
    tls: bool | None = None,
    root_certificates: str | None = None,
    tls_name: str | None = None,
    **config,
) -> TransformReport:
    """Restyle the video file ``source`` through the gateway at ``target`` into ``out``.  ``strength`` None:
    ``default_strength`` of the stream's ladder (asked from the gateway with a config the stream then repeats)."""
    _, _, _, count = video_info(source)
    with Client(target, token=token, tls=tls, root_certificates=root_certificates, tls_name=tls_name) as client:
        if strength is None:
            strength = default_strength(_ladder(client, prompt, config))
        tr = client.transform(os.fspath(source), prompt, strength=strength, timeout=timeout, **config)
        info = tr.info
        bar = tqdm(total=count or None, unit="frame", disable=not progress, desc="transforming")
        try:
            frames = tr.write_mp4(out, on_frame=lambda _frame: bar.update(1))
        finally:
            bar.close()
        return TransformReport(
            out=os.fspath(out),
            frames_in=tr.frames_sent,
            frames=frames,
            width=info.width,
            height=info.height,
            strength=info.config.strength,
            end_reason=tr.end.reason if tr.end else "unknown",
            ttff=tr.ttff,
            fps=tr.fps,
            seed=info.seed,
            timesteps=tuple(info.timesteps),
        )


PURE_NOISE_TIMESTEP = 1000.0  # the top of the training schedule: the input would be gone


def default_strength(ladder) -> float:
    """The first timestep of ``ladder`` that keeps some of the input: its second when its first is pure noise (and
    there is a second), else its first."""
    ladder = [float(t) for t in ladder]
    if not ladder:
        raise ValueError("timesteps: an empty ladder has no strength")
    if ladder[0] >= PURE_NOISE_TIMESTEP and len(ladder) > 1:
        return ladder[1]
    return ladder[0]


def _ladder(client: Client, prompt: str, config: dict) -> list[float]:
    """The ladder the gateway would run for ``config``: the timesteps given, else a short text stream's Started
    (cancelled at once)."""
    if config.get("timesteps"):
        return [float(t) for t in config["timesteps"]]
    probe = {k: v for k, v in config.items() if k in ("steps", "width", "height") and v is not None}
    gen = client.generate(prompt, seconds=0.1, **probe)
    try:
        return list(gen.info.timesteps)
    finally:
        gen.cancel()


def add_parser(sub) -> None:
    p = sub.add_parser(
        "transform",
        help="restyle a video file through a gateway into an MP4 (video-to-video; progress bar, TTFF, FPS)",
        formatter_class=HelpFormatter,
    )
    p.add_argument("--target", default="localhost:50051", help="gateway host:port")
    p.add_argument("--input", required=True, help="the video file to restyle (anything PyAV reads)")
    p.add_argument("--prompt", required=True, help="what the video should look like")
    p.add_argument("--out", default="out.mp4", help="the MP4 file to write")
    p.add_argument(
        "--strength",
        type=float,
        default=None,
        help="ladder timestep the input is noised to (default: the first that keeps some input: 750 on 1000,750,...)",
    )
    p.add_argument("--steps", type=int, default=None, help="ladder length (default: the gateway's)")
    p.add_argument("--timesteps", type=ladder_arg, default=None, help="the stream's own ladder, e.g. 700,500")
    p.add_argument("--width", type=int, default=None, help="pixels (default: the input's; it is scaled)")
    p.add_argument("--height", type=int, default=None, help="pixels (default: the input's)")
    p.add_argument("--seed", type=int, default=None, help="default: random")
    p.add_argument("--codec", choices=["h264", "jpeg", "raw"], default="h264", help="what travels back on the wire")
    p.add_argument("--input-format", choices=["jpeg", "raw"], default="jpeg", help="what input frames travel as")
    p.add_argument("--chunk-frames", type=int, default=None, help="latent frames per chunk")
    p.add_argument("--policy", choices=["clean", "per_level"], default=None, help="KV policy (default: the gateway's)")
    add_decoder_flag(p)
    p.add_argument("--window", type=int, default=None, help="KV window in latent frames (default: the gateway's)")
    p.add_argument("--sink", type=int, default=None, help="sink latent frames kept in the window")
    p.add_argument("--timeout", type=float, default=None, help="deadline for the whole call, seconds")
    p.add_argument("--token", default=None, help="bearer token (default: $STAGECAST_TOKEN; prefer --token-file)")
    p.add_argument("--token-file", default=None, help="file whose first line is the bearer token")
    p.add_argument("--tls", action="store_true", help="TLS with the system's root certificates")
    p.add_argument("--tls-ca", default=None, help="TLS, trusting this CA certificate (PEM) for the gateway")
    p.add_argument(
        "--tls-name", default=None, help="check the gateway's certificate for this name, not --target's host"
    )
    p.set_defaults(run=main)


def main(args: argparse.Namespace) -> int:
    from stagecast_client.errors import StagecastError

    try:
        token = token_from(args)
        video_info(args.input)
    except (OSError, ValueError) as exc:
        print(f"stagecast transform: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # PyAV's errors for a file it cannot read
        print(f"stagecast transform: error: --input {args.input}: {exc}", file=sys.stderr)
        return 2
    try:
        report = transform_clip(
            args.target,
            args.input,
            args.out,
            prompt=args.prompt,
            strength=args.strength,
            timeout=args.timeout,
            token=token,
            tls=args.tls or None,
            root_certificates=args.tls_ca,
            tls_name=args.tls_name,
            input_format=args.input_format,
            width=args.width,
            height=args.height,
            steps=args.steps,
            timesteps=args.timesteps,
            seed=args.seed,
            codec=args.codec,
            chunk_frames=args.chunk_frames,
            policy=args.policy,
            window=args.window,
            sink=args.sink,
            decoder=args.decoder,
        )
    except StagecastError as exc:
        print(f"stagecast transform: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:  # --tls-name
        print(f"stagecast transform: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("stagecast transform: aborted", file=sys.stderr)
        return INTERRUPTED
    print(report.summary())
    return 0
