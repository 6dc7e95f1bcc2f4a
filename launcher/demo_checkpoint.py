"""Every tiny or random checkpoint that tests, the demo, selftest and benchmarks write: the one home of writers.

The demo's folder, behind ``stagecast demo``, ``stagecast demo-checkpoint``, tests and the CPU Helm values::

    root = write_demo_checkpoint("~/.cache/stagecast/demo")   # idempotent: reuses a complete folder
    # root/transformer  tiny Wan2.1-style DiT (diffusers layout, sharded so stages read only their shards)
    # root/text_encoder root/tokenizer   tiny UMT5 + offline tokenizer (d_model == the DiT's text_dim)
    # root/vae          tiny Wan2.1-style VAE
    # root/stagecast.json  the gateway's serving defaults for it (text length 32, 64x64 frames)

Its parts, each on its own::

    write_transformer(folder, seed=0, name="tiny-wan2.1")       # a random DiT of a stagecast.model.dit_configs name
    write_checkpoint(folder, model.state_dict(), dict(model.config), layout="original", max_shard_bytes=4096)
    write_random_checkpoint(folder, "wan2.1-14b", torch.bfloat16)  # real size, one shard per block, on a GPU
    write_tiny_text_encoder(root, d_model=32)                    # root/text_encoder (random UMT5), root/tokenizer
    write_random_text_encoder(root)                              # a config only: the gateway draws UMT5-XXL's weights
    write_tiny_vae(folder, name="tiny-wan2.1")                   # a random AutoencoderKLWan of a vae_configs name
    write_tiny_decoder(path, latent_channels=16)                 # random tiny-decoder weights, published key layout

Same arguments give byte-identical files, and the caller's torch RNG state is left untouched (``write_transformer``
restores it).  The weights are random: the demo proves the system end to end (real processes, real gRPC, real data
plane, real codecs), not image quality.

The services hold only the loading code (``stage_service.checkpoint``, ``gateway.text_encoder``,
``gateway.decode.stream_vae``, ``gateway.decode.tiny_decoder``), so no service process carries test fixtures.  This
module sits on
the top floor because it takes what a file must look like from two services (the stage loader's file names, the
gateway's ``TinyDecoder`` module whose parameters the tiny decoder's weights fill); ``tests/test_layering.py`` fails
if a service defines a writer again.  The same arguments write the same bytes, and the caller's torch RNG state is left
as it was (``tests/test_checkpoint_writers.py``).
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import string
from collections.abc import Mapping
from os import PathLike
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from stagecast.api import DEFAULT_FPS
from stagecast.flags import HelpFormatter
from stagecast.model import vae_configs, wan_keys
from stagecast.model.config import CONFIG_NAME

if TYPE_CHECKING:
    from gateway.decode.tiny_decoder import TinyDecoder

logger = logging.getLogger(__name__)

DEMO_MODEL = "tiny-wan2.1"
DEMO_VAE = "tiny-wan2.1"
_MARKER = "stagecast-demo.json"
PARTS = ("transformer", "text_encoder", "tokenizer", "vae")
SERVING_DEFAULTS = "stagecast.json"  # read by gateway.checkpoint.ServingDefaults
DEMO_SERVING = {"text_len": 32, "width": 64, "height": 64, "fps": DEFAULT_FPS, "steps": 2}


# --- the transformer ----------------------------------------------------------------------------------------


def write_transformer(
    folder: Path,
    *,
    seed: int,
    name: str = DEMO_MODEL,
    max_shard_bytes: int = 64 * 1024,
    layout: str = "diffusers",
    **overrides,
) -> None:
    """Write a random transformer of a named config (``stagecast.model.dit_configs``).

    ``layout="original"`` writes the Wan-AI key names and ``WanModel`` config (as CausVid / Self-Forcing ship).
    """
    from diffusers import WanTransformer3DModel

    from stagecast.model.dit_configs import model_config

    cfg = model_config(name, **overrides)
    gen_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = WanTransformer3DModel(**cfg)
    finally:
        torch.random.set_rng_state(gen_state)
    write_checkpoint(folder, model.state_dict(), dict(model.config), layout=layout, max_shard_bytes=max_shard_bytes)


def write_checkpoint(
    folder: str | Path,
    state_dict: Mapping[str, torch.Tensor],
    config: Mapping,
    *,
    layout: wan_keys.Layout = "diffusers",
    max_shard_bytes: int | None = None,
    key_prefix: str = "",
) -> Path:
    """Write a diffusers-named ``state_dict`` (``model.state_dict()``) and ``config`` as a checkpoint folder.

    ``layout="diffusers"`` writes what ``WanTransformer3DModel.save_pretrained`` would (loadable by
    ``from_pretrained``); ``layout="original"`` renames keys to the original Wan names (behind ``key_prefix``,
    e.g. ``"model.diffusion_model."``) and writes a Wan-AI ``WanModel`` config.  With ``max_shard_bytes`` the
    tensors are split, in order, into ``diffusion_pytorch_model-0000k-of-0000n.safetensors`` shards of at most
    that size (a bigger tensor gets a shard of its own) plus the index json.  Returns the folder.
    """
    from safetensors.torch import save_file

    from stage_service.checkpoint import WEIGHTS_INDEX_NAME, WEIGHTS_NAME

    folder = Path(folder)
    if layout not in ("diffusers", "original"):
        raise ValueError(f"layout must be 'diffusers' or 'original', not {layout!r}")
    if key_prefix and layout != "original":
        raise ValueError("key_prefix only applies to layout='original'")
    folder.mkdir(parents=True, exist_ok=True)
    # Stale weights next to new ones would make the folder ambiguous (index vs single file), so refuse.
    existing = sorted(p.name for p in folder.iterdir() if p.name.endswith((".safetensors", ".index.json")))
    if existing:
        raise FileExistsError(f"{folder} already holds weights: {', '.join(existing)}")

    config = {k: v for k, v in config.items() if not k.startswith("_")}
    if layout == "original":
        config_json = wan_keys.diffusers_config_to_original(config)
        rename = functools.partial(wan_keys.diffusers_to_original, prefix=key_prefix)
    else:
        from diffusers import __version__ as diffusers_version

        config_json = {"_class_name": "WanTransformer3DModel", "_diffusers_version": diffusers_version, **config}
        rename = str
    (folder / CONFIG_NAME).write_text(json.dumps(config_json, indent=2, default=list) + "\n")

    # save_file needs contiguous, unshared CPU tensors.
    tensors = {rename(k): v.detach().to("cpu").contiguous() for k, v in state_dict.items()}
    metadata = {"format": "pt"}
    if max_shard_bytes is None:
        save_file(tensors, str(folder / WEIGHTS_NAME), metadata=metadata)
        logger.info("wrote %d tensors to %s", len(tensors), folder / WEIGHTS_NAME)
        return folder

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, tensor in tensors.items():
        if shards[-1] and size + tensor.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = tensor
        size += tensor.nbytes
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        name = f"diffusion_pytorch_model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / name), metadata=metadata)
        weight_map.update(dict.fromkeys(shard, name))
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())}, "weight_map": weight_map}
    (folder / WEIGHTS_INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    logger.info("wrote %d tensors in %d shards to %s", len(tensors), len(shards), folder)
    return folder


def write_random_checkpoint(folder: Path, name: str, dtype: torch.dtype, seed: int = 0) -> int:
    """Write the layer-ordered shards of a random ``name`` model (one shard in memory at a time); return bytes.

    A real-size checkpoint on disk (``benchmarks/startup.py``: the 14B is 28 GB in bfloat16), laid out the way
    ``stagecast convert`` writes one: embedders, patch embedding, one shard per block, head, so each stage opens only
    the shards of its own layers.  The numbers are drawn on a GPU when there is one."""
    from safetensors.torch import save_file

    from launcher.convert import shard_groups
    from stage_service.checkpoint import WEIGHTS_INDEX_NAME, load_dtype, model_shapes
    from stagecast.model.dit_configs import model_config

    config = model_config(name)
    shapes = model_shapes(config)
    folder.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # drawing 14B numbers on the CPU takes minutes
    gen = torch.Generator(device=device).manual_seed(seed)
    groups = shard_groups(list(shapes), config["num_layers"])
    weight_map, total = {}, 0
    for i, (_, names) in enumerate(groups, start=1):
        file = f"diffusion_pytorch_model-{i:05d}-of-{len(groups):05d}.safetensors"
        tensors = {}
        for key in names:
            t = torch.randn(shapes[key], generator=gen, device=device, dtype=torch.float32) * 0.02
            tensors[key] = t.to(load_dtype(key, torch.float32, dtype)).cpu().contiguous()
        save_file(tensors, str(folder / file), metadata={"format": "pt"})
        total += sum(t.nbytes for t in tensors.values())
        weight_map.update(dict.fromkeys(names, file))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / WEIGHTS_INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    (folder / CONFIG_NAME).write_text(
        json.dumps({"_class_name": "WanTransformer3DModel", **config}, indent=2, default=list) + "\n"
    )
    return total


# --- the text encoder: a tiny offline model, or a random one of the real size -------------------------------

# Whole-word pieces so typical test prompts tokenize into few tokens; anything else falls back to characters.
_TINY_WORDS = (
    "a an the of in on at to and with by from for is are over under into through near "
    "cat dog fox bird fish horse person man woman child robot car city street forest river ocean sea beach "
    "mountain snow rain sky sun moon night day light fire water tree flower field road house room "
    "red green blue yellow white black orange purple golden dark bright small big tall old young "
    "running walking flying swimming dancing jumping sitting standing driving falling "
    "slow fast motion camera shot close up wide view scene video cinematic realistic style "
    "high quality detailed beautiful sunset sunrise"
).split()

_SPM_SPACE = "\u2581"  # sentencepiece's word-boundary marker, as in the real T5/UMT5 tokenizers


def _build_tiny_tokenizer(model_max_length: int):
    """A T5-style Unigram tokenizer with a fixed vocabulary: deterministic, offline, no training step.

    Ids follow UMT5: <pad>=0, </s>=1, <unk>=2; ``</s>`` is appended to every sequence.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    chars = [c for c in string.printable if not c.isspace()]
    # Unigram picks the segmentation with the highest total log-probability, so whole words (-2) beat spelling
    # them out from word-initial (-4) and inner (-5) characters.
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), (_SPM_SPACE, -3.0)]
    vocab += [(_SPM_SPACE + w, -2.0) for w in _TINY_WORDS]
    vocab += [(_SPM_SPACE + c, -4.0) for c in chars]
    vocab += [(c, -5.0) for c in chars]

    tok = Tokenizer(models.Unigram(vocab, unk_id=2, byte_fallback=False))
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Replace(Regex(" {2,}"), " ")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=_SPM_SPACE, prepend_scheme="always", split=True)
    tok.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", 1)]
    )
    tok.decoder = decoders.Metaspace(replacement=_SPM_SPACE, prepend_scheme="always", split=True)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="</s>",
        unk_token="<unk>",
        model_max_length=model_max_length,
    )


UMT5_XXL = dict(d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64, vocab_size=256384)


def write_random_text_encoder(folder: str | PathLike, **dims) -> Path:
    """Write ``folder/text_encoder/config.json`` for a UMT5 encoder of ``dims`` (default: UMT5-XXL, Wan's) whose
    weights are drawn at random where it is loaded, and the tiny tokenizer (its ids are a subset of the vocabulary)."""
    from transformers import UMT5Config

    from gateway.text_encoder import DEFAULT_MAX_LEN, RANDOM_WEIGHTS_KEY

    folder = Path(folder)
    tokenizer = _build_tiny_tokenizer(model_max_length=DEFAULT_MAX_LEN)
    config = UMT5Config(
        **{**UMT5_XXL, **dims}, dropout_rate=0.0, feed_forward_proj="gated-gelu", pad_token_id=0, eos_token_id=1
    )
    if config.vocab_size < len(tokenizer):
        raise ValueError(f"vocab_size={config.vocab_size} is smaller than the tokenizer's {len(tokenizer)} ids")
    config.save_pretrained(folder / "text_encoder")
    data = json.loads((folder / "text_encoder" / "config.json").read_text())
    data[RANDOM_WEIGHTS_KEY] = True
    (folder / "text_encoder" / "config.json").write_text(json.dumps(data, indent=2))
    tokenizer.save_pretrained(folder / "tokenizer")
    return folder


def write_tiny_text_encoder(
    folder: str | PathLike,
    *,
    d_model: int = 32,
    num_layers: int = 2,
    num_heads: int = 4,
    d_kv: int = 8,
    d_ff: int = 64,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write ``folder/text_encoder`` (random UMT5EncoderModel) and ``folder/tokenizer``; return ``folder``.

    Same arguments give byte-identical files.  The caller's torch RNG state is left untouched.
    """
    from transformers import UMT5Config, UMT5EncoderModel

    from gateway.text_encoder import DEFAULT_MAX_LEN

    folder = Path(folder)
    tokenizer = _build_tiny_tokenizer(model_max_length=DEFAULT_MAX_LEN)
    config = UMT5Config(
        vocab_size=len(tokenizer),
        d_model=d_model,
        d_kv=d_kv,
        d_ff=d_ff,
        num_layers=num_layers,
        num_heads=num_heads,
        dropout_rate=0.0,
        feed_forward_proj="gated-gelu",  # as in umt5-xxl, which Wan uses
        pad_token_id=0,
        eos_token_id=1,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = UMT5EncoderModel(config)
    model.to(dtype).eval()

    model.save_pretrained(folder / "text_encoder")
    tokenizer.save_pretrained(folder / "tokenizer")
    logger.debug("wrote tiny UMT5 encoder (d_model=%d, vocab=%d) to %s", d_model, len(tokenizer), folder)
    return folder


# --- the VAE and the tiny decoder --------------------------------------------------------------------------


def write_tiny_vae(folder: str | PathLike, *, name: str = "tiny-wan2.1", seed: int = 0) -> Path:
    """Write a random ``AutoencoderKLWan`` of the named ``vae_configs`` preset to ``folder`` (diffusers layout).

    Same arguments give the same weights; the caller's torch RNG state is left untouched.
    """
    from diffusers import AutoencoderKLWan

    folder = Path(folder)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vae = AutoencoderKLWan(**vae_configs.vae_config(name))
    vae.eval().save_pretrained(folder)
    logger.debug("wrote random %s VAE to %s", name, folder)
    return folder


def _encoder_shapes(latent_channels: int, patch_size: int) -> dict[str, tuple[int, ...]]:
    """The published files' ``encoder.*`` keys (taew2_1 / taew2_2 time downscale (2, 2, 1)), which loading ignores."""
    shapes: dict[str, tuple[int, ...]] = {
        "encoder.0.weight": (64, 3 * patch_size**2, 3, 3),
        "encoder.0.bias": (64,),
    }
    for start, stride in ((2, 2), (7, 2), (12, 1)):
        shapes[f"encoder.{start}.conv.weight"] = (64, 64 * stride, 1, 1)
        shapes[f"encoder.{start + 1}.weight"] = (64, 64, 3, 3)
        for block in range(start + 2, start + 5):
            for j, n_in in ((0, 128), (2, 64), (4, 64)):
                shapes[f"encoder.{block}.conv.{j}.weight"] = (64, n_in, 3, 3)
                shapes[f"encoder.{block}.conv.{j}.bias"] = (64,)
    shapes["encoder.17.weight"] = (latent_channels, 64, 3, 3)
    shapes["encoder.17.bias"] = (latent_channels,)
    return shapes


@torch.no_grad()
def _random_init(model: TinyDecoder) -> None:
    """He-normal convs, residual branches damped and the last conv scaled around 0.5, so that random weights give
    frames spread over [0, 1] rather than a near-black (torch's default init) or saturated video."""
    for name, param in model.named_parameters():
        if param.dim() == 4:
            std = (2.0 / param[0].numel()) ** 0.5
            param.normal_(0.0, std * (0.3 if name.endswith("conv.4.weight") else 1.0))
        else:
            param.zero_()
    last = model.decoder[-1]
    last.weight.mul_(0.08)
    last.bias.fill_(0.5)


def write_tiny_decoder(path: str | PathLike, *, latent_channels: int = 16, patch_size: int = 1, seed: int = 0) -> Path:
    """Write random weights in the published key layout (``encoder.*`` and ``decoder.N...``) to ``path`` (.pth).

    Same arguments give the same weights; the caller's torch RNG state is left untouched."""
    from gateway.decode.tiny_decoder import TinyDecoder

    path = Path(path)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = TinyDecoder(latent_channels=latent_channels, patch_size=patch_size)
        _random_init(model)
        sd = dict(model.state_dict())
        for key, shape in _encoder_shapes(latent_channels, patch_size).items():
            sd[key] = torch.randn(shape) * 0.05
    torch.save(sd, path)
    logger.debug("wrote random tiny decoder (%d channels, patch %d) to %s", latent_channels, patch_size, path)
    return path


# --- the demo's folder ------------------------------------------------------------------------------------


def write_demo_checkpoint(out: str | Path, *, seed: int = 0, tiny_decoder: bool = False) -> Path:
    """Write (or complete) the demo checkpoint in ``out`` and return its path.

    ``tiny_decoder``: also a tiny streaming decoder with random weights in ``tiny_decoder/``
    (``gateway.decode.tiny_decoder``),
    so that a gateway on this checkpoint serves DECODER_TINY streams beside the VAE's (opt-in: it is ~45 MB and
    takes the gateway a second to load).

    Each part is written only if it is missing, so a folder from an older stagecast (e.g. without ``vae/``) is
    completed rather than rewritten; the marker file is written last, so an interrupted write is redone.
    """
    root = Path(out).expanduser()
    marker = root / _MARKER
    if marker.exists() and all((root / part).is_dir() for part in PARTS):
        if tiny_decoder:
            _write_tiny_decoder(root, seed)
        return root
    root.mkdir(parents=True, exist_ok=True)
    from stagecast.model.dit_configs import model_config

    text_dim = model_config(DEMO_MODEL)["text_dim"]
    if not (root / "transformer" / "config.json").exists():
        write_transformer(root / "transformer", seed=seed)
    if not (root / "text_encoder" / "config.json").exists() or not (root / "tokenizer").is_dir():
        write_tiny_text_encoder(root, d_model=text_dim, seed=seed)
    if not (root / "vae" / "config.json").exists():
        write_tiny_vae(root / "vae", name=DEMO_VAE, seed=seed)
    # Serving defaults the gateway reads (gateway.checkpoint): a short text length keeps the tiny model cheap, and a
    # small frame size keeps the CPU VAE fast. A real Wan checkpoint has no such file and gets 512 tokens, 832x480.
    (root / SERVING_DEFAULTS).write_text(json.dumps(DEMO_SERVING, indent=2) + "\n")
    if tiny_decoder:
        _write_tiny_decoder(root, seed)
    marker.write_text(json.dumps({"model": DEMO_MODEL, "vae": DEMO_VAE, "seed": seed}))
    logger.info("wrote demo checkpoint to %s", root)
    return root


def _write_tiny_decoder(root: Path, seed: int) -> None:
    folder = root / "tiny_decoder"
    if folder.is_dir() and any(folder.iterdir()):
        return
    from gateway.checkpoint import ModelInfo

    folder.mkdir(exist_ok=True)
    channels = ModelInfo.from_checkpoint(root).latent_channels
    write_tiny_decoder(folder / "random.pth", latent_channels=channels, seed=seed)


def add_parser(sub) -> None:
    p = sub.add_parser(
        "demo-checkpoint",
        help="write the tiny random demo checkpoint",
        formatter_class=HelpFormatter,
    )
    p.add_argument("--out", required=True, help="folder to write (transformer/, vae/, text_encoder/, tokenizer/)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    p.add_argument(
        "--tiny-decoder", action="store_true", help="also a tiny decoder (tiny_decoder/), for DECODER_TINY streams"
    )
    p.set_defaults(run=main)


def main(args: argparse.Namespace) -> int:
    path = write_demo_checkpoint(args.out, seed=args.seed, tiny_decoder=args.tiny_decoder)
    print(f"wrote demo checkpoint to {path}")
    return 0
