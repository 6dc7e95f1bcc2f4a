"""``--partition auto --balance-profile FILE``: one planner answer for the stages and the gateway's VAE cut.

Usage (``stagecast up``, ``stagecast selftest`` and the harness)::

    choice = resolve_balance("profile.json", transformer="random:wan2.1-1.3b", vae_folder=root / "vae",
                             stage_devices=["cuda:0", "cuda:1"], vae_devices=["cuda:0", "cuda:1"])
    choice.partition       # "17,13": the coordinator's --partition
    choice.vae_split       # [4], the gateway's --vae-split (None: the VAE is one part, or not planned)
    choice.describe()      # one line: the plan and its predicted per-GPU ms per chunk

The profile must have been measured on this model (``BalanceProfileError`` names the field otherwise): a ``random:``
checkpoint's preset name, the transformer's block count and shape, and the decoder units of ``vae_folder`` (the
units ``gateway.decode.stream_vae.decoder_units`` enumerates, which ``--vae-split`` counts).  Stage k runs on
``stage_devices[k]`` and VAE slice j on ``vae_devices[j]``; where the stages share one device (a CPU run), the plan
puts stage k on a lane of its own and the VAE slices on the stages' lanes in order (one slice: the last stage's,
where the gateway runs), as ``Placement`` does with one GPU per stage.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from stagecast.model.balance import BalancePlan, plan_balance
from stagecast.model.balance_profile import BalanceProfile

AUTO = "auto"


@dataclass(frozen=True)
class BalanceChoice:
    plan: BalancePlan
    profile: BalanceProfile

    @property
    def partition(self) -> str:
        return self.plan.partition

    @property
    def vae_split(self) -> list[int] | None:
        return list(self.plan.vae_split) if self.plan.vae_slice_ms and len(self.plan.vae_slice_ms) > 1 else None

    def describe(self) -> str:
        return (
            f"balanced by {self.profile.source}: {self.plan.flags()}; predicted ms per chunk per GPU: "
            f"{self.plan.gpu_ms_text()}"
        )


def check_flags(partition: str | None, profile: str | None, sp: int = 1, cfg_parallel: int = 1) -> None:
    """``--partition auto`` and ``--balance-profile`` go together, on one pipeline of whole-sequence stages:
    ValueError naming the flag otherwise."""
    if partition == AUTO and not profile:
        raise ValueError("--partition auto needs --balance-profile FILE (made by python -m benchmarks.balance)")
    if profile and partition != AUTO:
        raise ValueError("--balance-profile is read with --partition auto (give both, or neither)")
    if partition == AUTO and (sp > 1 or cfg_parallel > 1):
        raise ValueError("--partition auto: not with --sp or --cfg-parallel yet (give the layers per stage)")


def lanes(stage_devices: list[str], vae_devices: list[str]) -> tuple[list[str], list[str]]:
    """The planner's GPU of each stage and each VAE slice (see the module docstring for shared devices)."""
    if len(set(stage_devices)) == len(stage_devices):
        return list(stage_devices), list(vae_devices)
    stages = [f"lane {k}" for k in range(len(stage_devices))]
    if len(vae_devices) == 1:
        return stages, [stages[-1]]
    return stages, [stages[j % len(stages)] for j in range(len(vae_devices))]


def vae_unit_names(vae_folder: str | Path) -> list[str]:
    """The decoder units the gateway cuts at, from the VAE folder's config (built on the meta device: no weights)."""
    import torch
    from diffusers import AutoencoderKLWan

    from gateway.decode.stream_vae import decoder_units
    from stagecast.model.config import read_vae_config

    config = read_vae_config(vae_folder)
    with torch.device("meta"):
        vae = AutoencoderKLWan(**config)
    return [unit.name for unit in decoder_units(vae)]


def resolve_balance(
    profile_path: str | Path,
    *,
    transformer: str,
    stage_devices: list[str],
    vae_folder: str | Path | None = None,
    vae_devices: list[str] | None = None,
) -> BalanceChoice:
    """The planner's partition for ``stage_devices`` and, with ``vae_folder``, its VAE cut over ``vae_devices``
    (None: one part on the last stage's device, as the gateway runs it)."""
    profile = BalanceProfile.load(profile_path)
    from stagecast.model.config import RANDOM_PREFIX, checkpoint_config, checkpoint_folder

    if transformer.startswith(RANDOM_PREFIX) and checkpoint_folder(transformer) is None:  # random:NAME, a preset
        profile.check_model(name=transformer[len(RANDOM_PREFIX) :], config=checkpoint_config(transformer))
    else:
        profile.check_model(config=checkpoint_config(transformer))
    vae = []
    if vae_folder is not None:
        profile.check_vae_units(vae_unit_names(vae_folder))
        vae = list(vae_devices) if vae_devices else [stage_devices[-1]]
    stage_lanes, vae_lanes = lanes(list(stage_devices), vae)
    return BalanceChoice(plan=plan_balance(profile.costs(), stage_lanes, vae_lanes), profile=profile)
