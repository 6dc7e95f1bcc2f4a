"""The single-GPU peers and the compute floor: diffusers eager and compiled over the same work, and the FLOPs per
video frame over a measured bf16 matmul peak."""

from __future__ import annotations

import time

import torch

from benchmarks.harness.rows import LADDER, VAE_FOR_MODEL, branches_of, sync
from stagecast.model.dit_configs import model_config

# ---- floor ----------------------------------------------------------------------------------------------


def matmul_peak_tflops(device: torch.device, n: int) -> float:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    sync(device)
    reps = 10
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync(device)
    return 2 * n**3 * reps / (time.perf_counter() - t) / 1e12


def build_peer(args, device, dtype):
    from diffusers import AutoencoderKLWan, WanTransformer3DModel

    from stagecast.model.vae_configs import vae_config

    torch.manual_seed(0)
    with torch.device(device):
        dit = WanTransformer3DModel(**model_config(args.model)).to(dtype).eval().requires_grad_(False)
        vae = AutoencoderKLWan(**vae_config(VAE_FOR_MODEL[args.model])).to(dtype).eval().requires_grad_(False)
    return dit, vae


def latent_geometry(args, vae) -> tuple[int, int, int]:
    from stagecast.model.vae_configs import spatial_factor

    f = spatial_factor(dict(vae.config))
    return vae.config.z_dim, args.height // f, args.width // f


def flops_per_frame(args, dit, vae, device, dtype, text_len) -> dict:
    from torch.utils.flop_counter import FlopCounterMode

    from gateway.decode.stream_vae import StreamVAE

    c, h, w = latent_geometry(args, vae)
    x = torch.randn(1, c, 1, h, w, device=device, dtype=dtype)
    text = torch.randn(1, text_len, dit.config.text_dim, device=device, dtype=dtype)
    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        dit(x, torch.tensor([500.0], device=device), text)
    dit_flops = fc.get_total_flops()
    # KV window attention (not in a single-chunk forward): q.k and p.v over the cached frames, every layer.
    tokens = h // 2 * (w // 2)
    d = dit.config.num_attention_heads * dit.config.attention_head_dim
    window_flops = 4 * tokens * (args.window * tokens) * d * dit.config.num_layers
    sv = StreamVAE(vae)
    state = sv.new_state()
    with torch.no_grad():
        sv.decode_chunk(state, torch.randn(1, c, 1, h, w, device=device, dtype=dtype))  # frame 0: 1 video frame
        with FlopCounterMode(display=False) as fc:
            sv.decode_chunk(state, torch.randn(1, c, 1, h, w, device=device, dtype=dtype))
    vae_flops = fc.get_total_flops()
    sv.release(state)
    # Guidance runs the DiT twice per step (conditional and unconditional branch).
    per_latent = args.steps * branches_of(args) * (dit_flops + window_flops) + vae_flops
    return {
        "dit_tflop_per_forward": dit_flops / 1e12,
        "window_tflop_per_forward": window_flops / 1e12,
        "vae_tflop_per_latent_frame": vae_flops / 1e12,
        "tflop_per_video_frame": per_latent / 4 / 1e12,
    }


def run_peer(args, dit, vae, device, dtype, text_len, chunks: int, compiled: bool = False) -> dict:
    """diffusers, one GPU, sequential: every step of a chunk through the whole DiT, then VAE decode; eager, or with
    ``torch.compile`` on the DiT and the VAE decoder (compiled during the warm-up chunks, not timed)."""
    from gateway.decode.stream_vae import StreamVAE

    c, h, w = latent_geometry(args, vae)
    text = torch.randn(1, text_len, dit.config.text_dim, device=device, dtype=dtype)
    negative = torch.randn(1, text_len, dit.config.text_dim, device=device, dtype=dtype)
    model = torch.compile(dit, dynamic=False) if compiled else dit
    sv = StreamVAE(vae, compile=compiled)
    state = sv.new_state()
    timesteps = LADDER[: args.steps]
    frames, warm = 0, 3 if compiled else 2
    t0 = time.perf_counter()
    with torch.no_grad():
        for i in range(chunks + warm):
            if i == warm:  # warm-up chunks: frame 0 decodes alone, then the cache settles (and compiles run)
                sync(device)
                start, frames = time.perf_counter(), 0
            x = torch.randn(1, c, 1, h, w, device=device, dtype=dtype)
            for t in timesteps:
                v = model(x, torch.tensor([t], device=device), text, return_dict=False)[0]
                if args.guidance > 1.0:  # diffusers' WanPipeline: a second call with the negative prompt
                    u = model(x, torch.tensor([t], device=device), negative, return_dict=False)[0]
                    v = u + args.guidance * (v - u)
                x = x - (t / 1000.0) * v
            video = sv.decode_chunk(state, x)
            frames += video.shape[2]
        sync(device)
    elapsed = time.perf_counter() - start
    sv.release(state)
    return {"fps": frames / elapsed, "frames": frames, "seconds": elapsed, "warmup_s": start - t0}
