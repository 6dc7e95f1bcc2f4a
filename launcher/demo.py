"""``stagecast demo``: the whole system on this machine's CPU with a tiny random model, in one command.

Usage::

    stagecast demo                                  # 2 s of video from 2 stages into demo.mp4
    stagecast demo --seconds 1 --out clip.mp4 --stages 3
    stagecast demo --serve                          # then keep serving the live page until Ctrl-C
    run_demo(DemoConfig(seconds=1, out="clip.mp4"))   # -> exit code

It writes the demo checkpoint once into ``$STAGECAST_CACHE/demo`` (default ``~/.cache/stagecast/demo``), starts a
coordinator, K stages and a gateway as separate processes (real gRPC, real gloo data plane), streams the clip
through the public API with the client SDK, prints TTFF and FPS, and stops every process it started, also on
Ctrl-C (children die with the demo even if it is killed).  It also starts ``stagecast web`` and prints the live page's
URL; ``--serve`` keeps everything up after the clip, for the browser, until Ctrl-C.  The weights are random, so the
video is noise: the demo shows the system working end to end, not image quality.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from gateway.options import GatewayOptions
from launcher.demo_checkpoint import DEMO_SERVING, write_demo_checkpoint
from launcher.local_cluster import start_pipeline, web_args
from launcher.process import Launcher
from launcher.startup_view import StartupView
from stagecast.flags import HelpFormatter, to_argv
from stagecast.generate import generate_clip
from stagecast.service import stop_event

logger = logging.getLogger(__name__)

DEFAULT_PROMPT = "a red fox running through snow"


def default_cache() -> Path:
    return Path(os.environ.get("STAGECAST_CACHE") or Path.home() / ".cache" / "stagecast") / "demo"


@dataclass
class DemoConfig:
    seconds: float = 2.0
    out: str = "demo.mp4"
    stages: int = 2
    prompt: str = DEFAULT_PROMPT
    codec: str = "h264"
    seed: int = 0
    cache: str | None = None
    progress: bool = True
    web_port: int = 0  # the live page (0: any free port; -1: none)
    serve: bool = False  # keep serving the page after the clip, until Ctrl-C
    tiny_decoder: bool = False  # a random tiny decoder beside the VAE (the page's Decoder select can pick it)


def run_demo(cfg: DemoConfig) -> int:
    t0 = time.monotonic()
    root = write_demo_checkpoint(cfg.cache or default_cache(), tiny_decoder=cfg.tiny_decoder)
    print(f"demo checkpoint: {root}", flush=True)
    # One torch thread per process: K stages + the gateway share a few cores, and oversubscribed OpenMP spins.
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    with Launcher(env=env, startup=StartupView()) as launcher:
        print(
            f"starting a coordinator, {cfg.stages} stages and a gateway on CPU for a {DEMO_SERVING['width']}x"
            f"{DEMO_SERVING['height']}, {cfg.seconds:g} s clip of a tiny random model (noise, not pictures) ...",
            flush=True,
        )
        pipe = start_pipeline(launcher, checkpoint=str(root / "transformer"), stages=cfg.stages)
        gateway_options = GatewayOptions(coordinator=pipe.coordinator, checkpoint=str(root), port=0)
        gateway = launcher.spawn("gateway", ["gateway", *to_argv(gateway_options)])
        address = gateway.info["address"]  # the READY line comes once it serves
        bound = int(address.rsplit(":", 1)[1])  # a restart (--serve) keeps the port the page talks to
        gateway_args = ["gateway", *to_argv(dataclasses.replace(gateway_options, port=bound))]
        print(f"up in {time.monotonic() - t0:.1f} s: gateway {address}, coordinator {pipe.coordinator}", flush=True)
        if cfg.web_port >= 0:
            page = launcher.spawn("web", web_args(address, "127.0.0.1", cfg.web_port))
            until = "until Ctrl-C" if cfg.serve else "while the clip streams (--serve keeps it up after)"
            print(f"live page: {page.info['url']} ({until})", flush=True)
        report = generate_clip(
            address,
            cfg.out,
            prompt=cfg.prompt,
            seconds=cfg.seconds,
            codec=cfg.codec,
            seed=cfg.seed,
            progress=cfg.progress,
        )
        print(report.summary(), flush=True)
        if not cfg.serve and cfg.web_port >= 0:
            print(
                "the live page stops with the demo now: `stagecast demo --serve` keeps it up for a browser", flush=True
            )
        if cfg.serve and cfg.web_port >= 0:
            print(f"serving the live page at {page.info['url']} until Ctrl-C", flush=True)
            page_port = int(page.info["address"].rsplit(":", 1)[1])
            page_args = web_args(address, "127.0.0.1", page_port)
            failure = _supervise(launcher, pipe, (gateway, gateway_args), (page, page_args))
            if failure is not None:
                print(f"stagecast demo: {failure}", flush=True)
                return 1
    print(f"demo finished in {time.monotonic() - t0:.1f} s; every process stopped", flush=True)
    return 0


def _supervise(launcher: Launcher, pipe, gateway, page) -> str | None:
    """``--serve``: keep every process up until Ctrl-C as ``stagecast up`` does (one that dies is restarted with
    backoff, on its port; after too many deaths, why it gave up)."""
    from launcher.process import Supervisor
    from launcher.up import watch_pipeline

    supervisor = Supervisor(launcher, stop_event(), command="stagecast demo")
    watch_pipeline(supervisor, pipe)
    supervisor.watch(*gateway)
    supervisor.watch(*page)
    return supervisor.wait()


def add_parser(sub) -> None:
    p = sub.add_parser(
        "demo",
        help="run everything on CPU with a tiny random model and write an MP4",
        formatter_class=HelpFormatter,
    )
    p.add_argument("--seconds", type=float, default=2.0, help="seconds of video")
    p.add_argument("--out", default="demo.mp4", help="MP4 file to write")
    p.add_argument("--stages", type=int, default=2, help="DiT stage processes")
    p.add_argument("--prompt", default=None, help="what to generate (default: a built-in prompt)")
    p.add_argument("--codec", choices=["h264", "jpeg", "raw"], default="h264", help="what travels on the wire")
    p.add_argument("--seed", type=int, default=0, help="stream seed")
    p.add_argument("--cache", default=None, help="checkpoint cache (default: $STAGECAST_CACHE/demo or ~/.cache/...)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--web-port", type=int, default=0, help="the live browser page's port (0: any free one; -1: none)")
    p.add_argument("--serve", action="store_true", help="after the clip, keep serving the live page until Ctrl-C")
    p.add_argument(
        "--tiny-decoder",
        action="store_true",
        help="also serve a tiny decoder (random weights, written into the checkpoint cache): the page can pick it",
    )
    p.set_defaults(run=main)


def main(args: argparse.Namespace) -> int:
    return run_demo(
        DemoConfig(
            seconds=args.seconds,
            out=args.out,
            stages=args.stages,
            prompt=args.prompt or DEFAULT_PROMPT,
            codec=args.codec,
            seed=args.seed,
            cache=args.cache,
            progress=not args.no_progress,
            web_port=args.web_port,
            serve=args.serve,
            tiny_decoder=args.tiny_decoder,
        )
    )
