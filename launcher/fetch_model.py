"""Fill a model volume with a checkpoint once, and wait for it: the chart's model Job and its pods' initContainer.

Usage::

    # a diffusers checkpoint from Hugging Face
    python -m launcher.fetch_model fill --out /models/wan --repo Wan-AI/Wan2.1-T2V-1.3B-Diffusers
    # a real-time model: the base's VAE and text encoder, and a published .pt converted (`stagecast convert`)
    python -m launcher.fetch_model fill --out /models/sf --repo Wan-AI/Wan2.1-T2V-1.3B-Diffusers \
        --convert-repo gdhe17/Self-Forcing --convert-file checkpoints/self_forcing_dmd.pt --convert-source self-forcing
    # a folder already on another volume (a bucket mounted by a CSI driver, an NFS share)
    python -m launcher.fetch_model fill --out /models/wan --copy-from /seed/Wan2.1-T2V-1.3B-Diffusers
    # ... and a tiny decoder placed as the checkpoint's tiny_decoder/ (the gateway then serves DECODER_TINY)
    python -m launcher.fetch_model fill --out /models/wan --repo Wan-AI/Wan2.1-T2V-1.3B-Diffusers \
        --tiny-decoder-repo madebyollin/taehv --tiny-decoder-file taew2_1.pth
    # the stages and the gateway, before they start
    python -m launcher.fetch_model wait --out /models/sf --timeout 7200

``fill`` writes into ``<out>.partial`` and renames it to ``<out>`` when complete, then writes ``<out>/.stagecast-ready``
last; a volume that already has that file is left as it is, so the Job may run again (every ``helm upgrade``) at no
cost, and a Job killed half-way starts over from a clean ``.partial``. Hugging Face downloads go straight into the
volume (``local_dir``), with no second copy in a cache; a base used only for conversion fetches just ``vae/``,
``text_encoder/``, ``tokenizer/`` into ``<volume>/.stagecast-base/<repo>`` (the converted folder hard-links them).
A token, when the repository needs one, comes from ``$HF_TOKEN``.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import shutil
import sys
import time
from pathlib import Path

from gateway.checkpoint import TINY_DECODER_DIR, TINY_DECODER_SUFFIXES

logger = logging.getLogger("stagecast.fetch_model")

READY = ".stagecast-ready"
# Hugging Face repository ids (owner/name) and file paths inside them: what the download accepts.
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
_REPO_FILE = re.compile(r"^[A-Za-z0-9_.-][A-Za-z0-9_./-]{0,255}$")
BASE_PATTERNS = ["model_index.json", "vae/*", "text_encoder/*", "tokenizer/*"]
MAX_WAIT_S = 7 * 24 * 3600


class FetchError(Exception):
    """The volume cannot be filled as asked; the message names the flag."""


def is_ready(out: Path) -> bool:
    return (out / READY).is_file()


def _check(args: argparse.Namespace) -> None:
    sources = [bool(args.repo), bool(args.copy_from)]
    if sum(sources) != 1:
        raise FetchError("give exactly one of --repo (Hugging Face) and --copy-from (a mounted folder)")
    if args.repo and not _REPO_ID.match(args.repo):
        raise FetchError(f"--repo {args.repo!r}: a Hugging Face repository id, owner/name")
    convert = [args.convert_repo, args.convert_file, args.convert_source]
    if any(convert) and not all(convert):
        raise FetchError("--convert-repo, --convert-file and --convert-source go together")
    if args.convert_repo and not _REPO_ID.match(args.convert_repo):
        raise FetchError(f"--convert-repo {args.convert_repo!r}: a Hugging Face repository id, owner/name")
    if args.convert_file and (not _REPO_FILE.match(args.convert_file) or ".." in args.convert_file.split("/")):
        raise FetchError(f"--convert-file {args.convert_file!r}: a file path inside --convert-repo")
    if args.convert_repo and args.copy_from:
        raise FetchError("--convert-repo needs --repo (the base whose VAE and text encoder the converted model uses)")
    if bool(args.tiny_decoder_repo) != bool(args.tiny_decoder_file):
        raise FetchError("--tiny-decoder-repo and --tiny-decoder-file go together")
    if args.tiny_decoder_repo and not _REPO_ID.match(args.tiny_decoder_repo):
        raise FetchError(f"--tiny-decoder-repo {args.tiny_decoder_repo!r}: a Hugging Face repository id, owner/name")
    if args.tiny_decoder_file and (
        not _REPO_FILE.match(args.tiny_decoder_file)
        or ".." in args.tiny_decoder_file.split("/")
        or not args.tiny_decoder_file.endswith(TINY_DECODER_SUFFIXES)
    ):
        raise FetchError(
            f"--tiny-decoder-file {args.tiny_decoder_file!r}: a .pth or .safetensors path inside --tiny-decoder-repo"
        )
    if args.copy_from and not Path(args.copy_from).is_dir():
        raise FetchError(f"--copy-from {args.copy_from}: not a folder")


def _download(repo: str, revision: str | None, dest: Path, patterns: list[str] | None = None) -> Path:
    from huggingface_hub import snapshot_download

    logger.info("downloading %s%s into %s", repo, f"@{revision}" if revision else "", dest)
    with _hub(repo):
        snapshot_download(repo, revision=revision or None, local_dir=dest, allow_patterns=patterns)
    return dest


@contextlib.contextmanager
def _hub(repo: str):
    """A download that cannot reach the Hub (no network, a private repository without ``$HF_TOKEN``, a repository
    or revision that does not exist) is one line naming what to do instead, not the Hub library's traceback."""
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        yield
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise FetchError(
            f"--repo {repo}: cannot download it from the Hugging Face Hub ({first[:200]}). Without the Hub, fill "
            "the volume from a mounted folder instead: --copy-from DIR (the chart's model.fill.copyFrom)"
        ) from None


def fill(args: argparse.Namespace) -> Path:
    """Fill ``args.out`` as asked (see the module docstring); returns it.  Already filled: returns at once."""
    _check(args)
    out = Path(args.out)
    if is_ready(out):
        logger.info("%s is ready (%s): nothing to do", out, READY)
        return out
    if out.exists():
        raise FetchError(f"--out {out}: exists without {READY}; remove it (an earlier fill did not finish)")
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    if args.copy_from:
        logger.info("copying %s into %s", args.copy_from, out)
        shutil.copytree(args.copy_from, partial, symlinks=False)
    elif args.convert_repo:
        from huggingface_hub import hf_hub_download

        from launcher.convert import convert

        base = _download(args.repo, args.revision, out.parent / ".stagecast-base" / args.repo, BASE_PATTERNS)
        pt_dir = out.parent / ".stagecast-base" / args.convert_repo
        logger.info("downloading %s from %s", args.convert_file, args.convert_repo)
        with _hub(args.convert_repo):
            pt = hf_hub_download(args.convert_repo, args.convert_file, revision=args.convert_revision, local_dir=pt_dir)
        report = convert(pt, partial, source=args.convert_source, base=base)
        logger.info(
            "converted %s: %d layers, sampler %s", args.convert_file, report.config["num_layers"], report.sampler
        )
    else:
        _download(args.repo, args.revision, partial)
    if args.tiny_decoder_repo:
        place_tiny_decoder(args.tiny_decoder_repo, args.tiny_decoder_file, partial)
    partial.rename(out)
    (out / READY).write_text("complete\n")
    logger.info("%s is ready", out)
    return out


def place_tiny_decoder(repo: str, file: str, checkpoint: Path) -> Path:
    """The tiny decoder's weights as the checkpoint's ``tiny_decoder/<name>``, the one file the gateway looks for there
    (an earlier one is replaced): the gateway then serves ``DECODER_TINY`` streams without a flag."""
    from huggingface_hub import hf_hub_download

    folder = checkpoint / TINY_DECODER_DIR
    shutil.rmtree(folder, ignore_errors=True)
    staging = checkpoint.parent / ".stagecast-base" / repo
    logger.info("downloading the tiny decoder %s from %s", file, repo)
    with _hub(repo):
        got = Path(hf_hub_download(repo, file, local_dir=staging))
    folder.mkdir(parents=True)
    target = folder / Path(file).name
    shutil.copyfile(got, target)
    return target


def wait(out: Path, timeout: float, poll: float = 5.0) -> bool:
    """Block until ``out`` holds a complete checkpoint; False after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not is_ready(out):
        if time.monotonic() >= deadline:
            return False
        time.sleep(min(poll, max(0.0, deadline - time.monotonic())))
    return True


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m launcher.fetch_model", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    f = sub.add_parser("fill", help="fill --out with a checkpoint once (the chart's model Job)")
    f.add_argument("--out", required=True, help="the checkpoint folder to write (on the model volume)")
    f.add_argument("--repo", default=None, help="Hugging Face repository of a diffusers checkpoint (owner/name)")
    f.add_argument("--revision", default=None, help="branch, tag or commit of --repo (default: main)")
    f.add_argument("--copy-from", default=None, help="copy this mounted folder instead of downloading")
    f.add_argument("--convert-repo", default=None, help="Hugging Face repository of a .pt to convert")
    f.add_argument("--convert-file", default=None, help="the .pt's path inside --convert-repo")
    f.add_argument("--convert-revision", default=None, help="branch, tag or commit of --convert-repo")
    f.add_argument(
        "--convert-source", default=None, choices=["causvid", "self-forcing", "streamdiffusionv2"], help="who wrote it"
    )
    f.add_argument(
        "--tiny-decoder-repo", default=None, help="Hugging Face repository of a tiny decoder, e.g. madebyollin/taehv"
    )
    f.add_argument("--tiny-decoder-file", default=None, help="its weights inside --tiny-decoder-repo, e.g. taew2_1.pth")
    w = sub.add_parser("wait", help="wait until --out is complete (the pods' initContainer)")
    w.add_argument("--out", required=True, help="the checkpoint folder to wait for")
    w.add_argument("--timeout", type=float, default=7200.0, help="seconds before giving up")
    return p


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    args = build_parser().parse_args(argv)
    if args.command == "wait":
        if not 0 < args.timeout <= MAX_WAIT_S:
            print(f"fetch_model: error: --timeout must be in (0, {MAX_WAIT_S}], got {args.timeout:g}", file=sys.stderr)
            return 2
        logger.info("waiting for %s (the model Job writes it)", Path(args.out) / READY)
        if wait(Path(args.out), args.timeout):
            return 0
        print(
            f"fetch_model: error: {args.out} is not complete after {args.timeout:g} s: see the model Job's log "
            "(kubectl logs -l app.kubernetes.io/component=model)",
            file=sys.stderr,
        )
        return 1
    try:
        fill(args)
    except FetchError as exc:
        print(f"fetch_model: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    os.umask(0o022)
    sys.exit(main())
