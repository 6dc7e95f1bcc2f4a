"""``stagecast generate``: stream one clip from a gateway into an MP4, with a progress bar, TTFF and FPS.

Usage::

    stagecast generate --target localhost:50051 --prompt "a red fox in snow" --seconds 4 --out clip.mp4
    report = generate_clip("localhost:50051", "clip.mp4", prompt="a red fox in snow", seconds=4)
    report.frames, report.ttff, report.fps

Without ``--seconds`` the stream runs until Ctrl-C, which stops it gracefully (the frames of chunks in flight are
still written).  TTFF is measured at the client, from sending the config to receiving the first frame; FPS is the
stream's steady rate, over the later half of its time (``stagecast.arrivals``), and a paced stream's start burst (its
playout buffer, delivered at once) is reported apart.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from dataclasses import dataclass, field

from tqdm import tqdm

from stagecast_client.cli import INTERRUPTED
from stagecast_client.client import Client, Generation
from stagecast_client.helpformat import HelpFormatter

logger = logging.getLogger(__name__)


@dataclass
class GenerateReport:
    out: str
    frames: int
    width: int
    height: int
    codec: str
    seed: int
    end_reason: str
    ttff: float | None
    fps: float | None
    timesteps: tuple[float, ...] = ()  # the ladder the stream started with
    shift: float = 1.0
    steps: dict[int, int] = field(default_factory=dict)  # denoising steps -> frames whose chunk ran them
    decoder: str = "full"  # what turned the latents into frames
    burst_frames: int = 0  # frames delivered beyond the steady rate at the start (the playout buffer)
    pipeline: str = ""  # the pipeline that served it (Started.pipeline; behind a fleet's door, the one it chose)

    def summary(self) -> str:
        ttff = f"{self.ttff:.3f} s" if self.ttff is not None else "n/a"
        fps = f"{self.fps:.1f}" if self.fps is not None else "n/a"
        if self.burst_frames:
            fps += f" steady (after a start burst of {self.burst_frames} frames)"
        ladder = ", ".join(f"{t:g}" for t in self.timesteps)
        adaptive = ""
        if len(self.steps) > 1:  # the SLO controller changed the steps during the stream
            adaptive = "; steps " + ", ".join(f"{s}: {n} frames" for s, n in sorted(self.steps.items(), reverse=True))
        return (
            f"wrote {self.out}: {self.frames} frames {self.width}x{self.height} ({self.codec}, seed {self.seed}, "
            f"timesteps [{ladder}] shift {self.shift:g}, {self.decoder} decoder, {self.end_reason}); TTFF {ttff}; "
            f"FPS {fps}{adaptive}" + (f"; pipeline {self.pipeline}" if self.pipeline else "")
        )


def generate_clip(
    target: str,
    out: str | os.PathLike,
    *,
    prompt: str,
    progress: bool = True,
    timeout: float | None = None,
    token: str | None = None,
    tls: bool | None = None,
    root_certificates: str | None = None,
    tls_name: str | None = None,
    **config,
) -> GenerateReport:
    """Stream a clip from the gateway at ``target`` into ``out``; ``config`` as for ``Client.generate``; ``token``,
    ``tls``, ``root_certificates`` and ``tls_name`` as for ``Client``."""
    # An unbounded stream (no seconds) ends gracefully on Ctrl-C: the handler is in place before the stream opens,
    # so a Ctrl-C that comes while it opens (the gateway already counts it) stops it as soon as it is open.
    gen: Generation | None = None
    asked = False

    def stop() -> None:
        nonlocal asked
        if gen is None:
            asked = True
        else:
            gen.stop()

    restore = _stop_on_interrupt(stop) if config.get("seconds") is None else None
    try:
        with Client(target, token=token, tls=tls, root_certificates=root_certificates, tls_name=tls_name) as client:
            gen = client.generate(prompt, timeout=timeout, **config)
            if asked:
                gen.stop()
            info = gen.info
            if info.total_frames is not None and restore is not None:  # bounded after all: Ctrl-C aborts
                restore()
                restore = None
            bar = tqdm(total=info.total_frames, unit="frame", disable=not progress, desc="generating")
            steps: dict[int, int] = {}

            def on_frame(frame) -> None:
                bar.update(1)
                steps[frame.steps] = steps.get(frame.steps, 0) + 1

            try:
                frames = gen.write_mp4(out, on_frame=on_frame)
            finally:
                bar.close()
            return GenerateReport(
                out=os.fspath(out),
                frames=frames,
                width=info.width,
                height=info.height,
                codec=info.codec,
                seed=info.seed,
                end_reason=gen.end.reason if gen.end else "unknown",
                ttff=gen.ttff,
                fps=gen.steady_fps,
                timesteps=info.timesteps,
                shift=info.shift,
                steps=steps,
                decoder=info.decoder,
                burst_frames=gen.burst_frames,
                pipeline=info.pipeline,
            )
    finally:
        if restore is not None:
            restore()


def _stop_on_interrupt(stop):
    """Make Ctrl-C end an unbounded stream gracefully (once); returns a function restoring the old handler."""
    if threading.current_thread() is not threading.main_thread():
        return None
    previous = signal.getsignal(signal.SIGINT)

    def handler(signum, frame):
        print("\nstopping: the frames of chunks in flight are still written (Ctrl-C again to abort)", flush=True)
        signal.signal(signal.SIGINT, previous)
        stop()

    signal.signal(signal.SIGINT, handler)
    return lambda: signal.signal(signal.SIGINT, previous)


def ladder_arg(text: str) -> list[float]:
    """``700,500,400,200`` -> ``[700.0, 500.0, 400.0, 200.0]`` (the server checks the ladder itself)."""
    try:
        return [float(t) for t in text.split(",")]
    except ValueError:
        msg = f"a comma-separated list of timesteps, e.g. 700,500,400,200; got {text!r}"
        raise argparse.ArgumentTypeError(msg) from None


def add_decoder_flag(p: argparse.ArgumentParser) -> None:
    """``--decoder``, shared by generate and transform."""
    p.add_argument(
        "--decoder",
        choices=["full", "tiny"],
        default=None,
        help="full: the model's VAE (exact); tiny: the deployment's tiny decoder (approximate, far cheaper per frame); "
        "default: the gateway's",
    )


def add_parser(sub) -> None:
    p = sub.add_parser(
        "generate",
        help="stream a clip from a gateway into an MP4 (progress bar, TTFF, FPS)",
        formatter_class=HelpFormatter,
    )
    p.add_argument("--target", default="localhost:50051", help="gateway host:port")
    p.add_argument("--prompt", required=True, help="what to generate")
    p.add_argument("--seconds", type=float, default=None, help="duration (default: until Ctrl-C)")
    p.add_argument("--out", default="clip.mp4", help="the MP4 file to write")
    p.add_argument("--width", type=int, default=None, help="pixels (default: the gateway's)")
    p.add_argument("--height", type=int, default=None, help="pixels (default: the gateway's)")
    p.add_argument("--steps", type=int, default=None, help="denoising steps (default: the gateway's)")
    p.add_argument(
        "--timesteps",
        type=ladder_arg,
        default=None,
        help="the stream's own timestep ladder, e.g. 700,500,400,200 (default: the checkpoint's for --steps)",
    )
    p.add_argument("--seed", type=int, default=None, help="default: random (printed)")
    p.add_argument(
        "--image", default=None, help="first frame, a JPEG or PNG at the stream's size (image-to-video: Wan2.2-TI2V)"
    )
    p.add_argument("--codec", choices=["h264", "jpeg", "raw"], default="h264", help="what travels on the wire")
    p.add_argument("--chunk-frames", type=int, default=None, help="latent frames per chunk")
    p.add_argument("--fps", type=float, default=None, help="target fps (default: the gateway's)")
    p.add_argument("--min-steps", type=int, default=None, help="SLO-adaptive: the fewest steps a chunk may run")
    p.add_argument("--max-steps", type=int, default=None, help="SLO-adaptive: the most steps a chunk may run")
    p.add_argument(
        "--steps-preference",
        choices=["steps_first", "latency_first"],
        default=None,
        help="SLO-adaptive: spend spare capacity on steps (quality) or hold --min-steps (latency)",
    )
    p.add_argument(
        "--no-pace",
        dest="pace",
        action="store_false",
        default=None,
        help="generate as fast as the pipeline allows, not at --fps (offline renders)",
    )
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


def token_from(args: argparse.Namespace) -> str | None:
    """--token, else the first line of --token-file, else $STAGECAST_TOKEN; None when none is given."""
    if args.token and args.token_file:
        raise ValueError("--token and --token-file exclude each other")
    if args.token_file:
        with open(args.token_file, encoding="utf-8") as f:
            token = f.readline().strip()
        if not token:
            raise ValueError(f"--token-file {args.token_file}: the first line is empty")
        return token
    return args.token or os.environ.get("STAGECAST_TOKEN") or None


def main(args: argparse.Namespace) -> int:
    from stagecast_client.errors import StagecastError

    try:
        token = token_from(args)
    except (OSError, ValueError) as exc:
        print(f"stagecast generate: error: {exc}", file=sys.stderr)
        return 2
    try:
        report = generate_clip(
            args.target,
            args.out,
            prompt=args.prompt,
            timeout=args.timeout,
            token=token,
            tls=args.tls or None,
            root_certificates=args.tls_ca,
            tls_name=args.tls_name,
            seconds=args.seconds,
            width=args.width,
            height=args.height,
            steps=args.steps,
            timesteps=args.timesteps,
            seed=args.seed,
            image=args.image,
            codec=args.codec,
            chunk_frames=args.chunk_frames,
            target_fps=args.fps,
            policy=args.policy,
            window=args.window,
            sink=args.sink,
            pace=args.pace,
            min_steps=args.min_steps,
            max_steps=args.max_steps,
            steps_preference=args.steps_preference,
            decoder=args.decoder,
        )
    except StagecastError as exc:
        print(f"stagecast generate: {exc}", file=sys.stderr)
        return 1
    except (OSError, ValueError) as exc:  # --image or --out; --tls-name
        print(f"stagecast generate: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        # A second Ctrl-C aborts at once: one line, no traceback (130 as shells report SIGINT).
        print("stagecast generate: aborted", file=sys.stderr)
        return INTERRUPTED
    print(report.summary())
    return 0
