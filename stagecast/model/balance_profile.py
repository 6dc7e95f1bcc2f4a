"""The balance profile: measured DiT and VAE times per chunk, the input of ``stagecast.model.balance``.

Made on the deployment's GPU by ``python -m benchmarks.balance`` and read by ``stagecast up --partition auto
--balance-profile FILE`` (and the harness, and ``stagecast simulate``)::

    profile = BalanceProfile.load("profile.json")          # BalanceProfileError names the field of a bad file
    profile.check_model(name="wan2.1-1.3b", config=cfg)     # the deployment's model, or an error naming the field
    profile.check_vae_units(["conv_in", "mid_block", ...])  # the decoder the gateway will cut
    plan = plan_balance(profile.costs(), stage_gpus, vae_gpus)

The JSON (``format`` "stagecast.balance-profile", ``version`` 1)::

    {"format": "stagecast.balance-profile", "version": 1,
     "model": "wan2.1-1.3b", "dit_config": {"num_layers": 30, "num_attention_heads": 12, ...},
     "width": 832, "height": 480, "steps": 1, "batch": 1, "policy": "per_level", "window": 6, "sink": 3,
     "text_len": 512, "dtype": "bfloat16", "device": "NVIDIA H200", "cuda_graphs": true, "vae_compile": true,
     "dit": {"blocks_ms": [0.47, ...], "stage_ms": 0.31, "first_ms": 0.12, "last_ms": 0.55},
     "vae": {"units": [{"name": "conv_in", "ms": 0.9}, {"name": "mid_block", "ms": 3.1}, ...]},
     "measured": {"iters": 30, "date": "...", "commit": "...", "command": "..."}}

Every time is milliseconds per chunk in the steady state of the benchmark protocol (one latent frame per chunk, the
``per_level`` policy, a KV window of ``window`` frames with ``sink`` sinks): per chunk each stage runs one forward of
``batch`` (= ``steps``) micro-steps, one per denoising level, and the VAE decodes one latent frame.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from stagecast.model.balance import MAX_BLOCKS, MAX_MS, MAX_VAE_UNITS, BalanceCosts

FORMAT = "stagecast.balance-profile"
VERSION = 1
MAX_FILE_BYTES = 1 << 20
# The architecture keys a profile records and a deployment's model must match.
DIT_KEYS = ("num_layers", "num_attention_heads", "attention_head_dim", "ffn_dim", "in_channels")


class BalanceProfileError(ValueError):
    """A profile that cannot be used; the message names the file's field."""


@dataclass
class BalanceProfile:
    model: str
    dit_config: dict[str, int]
    blocks_ms: list[float]
    vae_units: list[tuple[str, float]]
    stage_ms: float = 0.0
    first_ms: float = 0.0
    last_ms: float = 0.0
    width: int = 832
    height: int = 480
    steps: int = 1
    batch: int = 1
    policy: str = "per_level"
    window: int = 6
    sink: int = 3
    text_len: int = 512
    dtype: str = "bfloat16"
    device: str = ""
    cuda_graphs: bool = False
    vae_compile: bool = False
    measured: dict = field(default_factory=dict)
    source: str = "profile"  # where it was read from, for messages

    # ---- reading and writing --------------------------------------------------------------------------

    @classmethod
    def load(cls, path: str | Path) -> BalanceProfile:
        path = Path(path)
        try:
            size = path.stat().st_size
        except OSError as exc:
            raise BalanceProfileError(f"balance profile {path}: cannot read it ({exc.strerror})") from None
        if size > MAX_FILE_BYTES:
            raise BalanceProfileError(f"balance profile {path}: {size} bytes, over the limit of {MAX_FILE_BYTES}")
        try:
            data = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise BalanceProfileError(f"balance profile {path}: not JSON ({exc})") from None
        return cls.from_json(data, source=f"balance profile {path}")

    @classmethod
    def from_json(cls, data, *, source: str = "balance profile") -> BalanceProfile:
        r = _Reader(source)
        if not isinstance(data, dict):
            r.fail("(top level)", "must be a JSON object")
        if data.get("format") != FORMAT:
            r.fail("format", f"must be {FORMAT!r}, got {data.get('format')!r}")
        if data.get("version") != VERSION:
            r.fail("version", f"this reader knows version {VERSION}, got {data.get('version')!r}")
        model = r.get(data, "model", str)
        if not 0 < len(model) <= 200:
            r.fail("model", "must be a name of 1..200 characters")
        dit_config = r.get(data, "dit_config", dict)
        for key in DIT_KEYS:
            value = r.get(dit_config, key, int, "dit_config.")
            if not 0 < value <= 1 << 20:
                r.fail(f"dit_config.{key}", f"must be a positive count, got {value}")
        dit = r.get(data, "dit", dict)
        blocks_ms = r.blocks(dit, dit_config["num_layers"])
        vae_units = r.vae_units(r.get(data, "vae", dict))
        dtype = r.get(data, "dtype", str)
        if dtype not in ("float32", "bfloat16", "float16"):
            r.fail("dtype", f"must be float32, bfloat16 or float16, got {dtype!r}")
        policy = r.get(data, "policy", str)
        if policy not in ("per_level", "clean"):
            r.fail("policy", f"must be per_level or clean, got {policy!r}")
        device = r.get(data, "device", str)
        if len(device) > 200:
            r.fail("device", "must be at most 200 characters")
        measured = data.get("measured", {})
        if not isinstance(measured, dict):
            r.fail("measured", "must be an object")
        return cls(
            model=model,
            dit_config={k: dit_config[k] for k in DIT_KEYS},
            blocks_ms=blocks_ms,
            vae_units=vae_units,
            stage_ms=r.ms(dit, "stage_ms", "dit."),
            first_ms=r.ms(dit, "first_ms", "dit."),
            last_ms=r.ms(dit, "last_ms", "dit."),
            width=r.count(data, "width", 1, 1 << 16),
            height=r.count(data, "height", 1, 1 << 16),
            steps=r.count(data, "steps", 1, 1000),
            batch=r.count(data, "batch", 1, 1000),
            policy=policy,
            window=r.count(data, "window", 0, 1 << 16),
            sink=r.count(data, "sink", 0, 1 << 16),
            text_len=r.count(data, "text_len", 1, 1 << 16),
            dtype=dtype,
            device=device,
            cuda_graphs=r.get(data, "cuda_graphs", bool),
            vae_compile=r.get(data, "vae_compile", bool),
            measured=measured,
            source=source,
        )

    def to_json(self) -> dict:
        return {
            "format": FORMAT,
            "version": VERSION,
            "model": self.model,
            "dit_config": dict(self.dit_config),
            "width": self.width,
            "height": self.height,
            "steps": self.steps,
            "batch": self.batch,
            "policy": self.policy,
            "window": self.window,
            "sink": self.sink,
            "text_len": self.text_len,
            "dtype": self.dtype,
            "device": self.device,
            "cuda_graphs": self.cuda_graphs,
            "vae_compile": self.vae_compile,
            "dit": {
                "blocks_ms": list(self.blocks_ms),
                "stage_ms": self.stage_ms,
                "first_ms": self.first_ms,
                "last_ms": self.last_ms,
            },
            "vae": {"units": [{"name": n, "ms": t} for n, t in self.vae_units]},
            "measured": dict(self.measured),
        }

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")

    # ---- use ------------------------------------------------------------------------------------------

    def costs(self) -> BalanceCosts:
        return BalanceCosts(
            blocks_ms=tuple(self.blocks_ms),
            vae_units_ms=tuple(t for _, t in self.vae_units),
            stage_ms=self.stage_ms,
            first_ms=self.first_ms,
            last_ms=self.last_ms,
        )

    def check_model(self, *, name: str | None = None, config: dict | None = None) -> None:
        """Raise ``BalanceProfileError`` naming the field unless the profile was measured on this model: ``name`` a
        preset name (``random:NAME`` checkpoints), ``config`` the transformer config (block count and shape)."""
        if name is not None and name != self.model:
            raise BalanceProfileError(f"{self.source}: model: measured on {self.model!r}, the deployment runs {name!r}")
        if config is not None:
            for key in DIT_KEYS:
                if config.get(key) != self.dit_config[key]:
                    what = "block count" if key == "num_layers" else "architecture"
                    raise BalanceProfileError(
                        f"{self.source}: dit_config.{key}: the profile's {what} is {self.dit_config[key]}, the "
                        f"deployment's model has {config.get(key)!r}"
                    )

    def check_vae_units(self, names: list[str]) -> None:
        """Raise ``BalanceProfileError`` naming ``vae.units`` unless the profile times exactly these decoder units."""
        mine = [n for n, _ in self.vae_units]
        if mine != list(names):
            raise BalanceProfileError(
                f"{self.source}: vae.units: the profile times units {mine}, the deployment's VAE decoder cuts at "
                f"{list(names)}"
            )

    def check_run(self, *, steps: int | None = None, width: int | None = None, height: int | None = None) -> None:
        """Raise ``BalanceProfileError`` naming the field when a run's fixed settings differ from the profile's."""
        for name, value in (("steps", steps), ("width", width), ("height", height)):
            if value is not None and value != getattr(self, name):
                raise BalanceProfileError(
                    f"{self.source}: {name}: measured at {getattr(self, name)}, this run uses {value}"
                )


class _Reader:
    """Typed reads of a profile's JSON; every failure is a ``BalanceProfileError`` naming the key path."""

    def __init__(self, source: str):
        self.source = source

    def fail(self, name: str, why: str):
        raise BalanceProfileError(f"{self.source}: {name}: {why}")

    def get(self, obj: dict, name: str, kind, where: str = ""):
        full = f"{where}{name}"
        if name not in obj:
            self.fail(full, "missing")
        value = obj[name]
        ok = isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))
        if kind is float:
            ok = isinstance(value, int | float) and not isinstance(value, bool)
        if not ok:
            self.fail(full, f"must be {kind.__name__}, got {value!r}")
        return value

    def ms(self, obj: dict, name: str, where: str) -> float:
        value = float(self.get(obj, name, float, where))
        if not math.isfinite(value) or not 0 <= value <= MAX_MS:
            self.fail(f"{where}{name}", f"must be finite ms in [0, {MAX_MS:g}], got {value!r}")
        return value

    def count(self, data: dict, name: str, lo: int, hi: int) -> int:
        value = self.get(data, name, int)
        if not lo <= value <= hi:
            self.fail(name, f"must be in [{lo}, {hi}], got {value}")
        return value

    def blocks(self, dit: dict, num_layers: int) -> list[float]:
        blocks = self.get(dit, "blocks_ms", list, "dit.")
        if not 0 < len(blocks) <= MAX_BLOCKS:
            self.fail("dit.blocks_ms", f"must list 1..{MAX_BLOCKS} blocks, got {len(blocks)}")
        if len(blocks) != num_layers:
            self.fail("dit.blocks_ms", f"has {len(blocks)} blocks but dit_config.num_layers is {num_layers}")
        return [self.ms({"": v}, "", f"dit.blocks_ms[{i}]") for i, v in enumerate(blocks)]

    def vae_units(self, vae: dict) -> list[tuple[str, float]]:
        units = self.get(vae, "units", list, "vae.")
        if len(units) > MAX_VAE_UNITS:
            self.fail("vae.units", f"must list at most {MAX_VAE_UNITS} units, got {len(units)}")
        out = []
        for i, unit in enumerate(units):
            where = f"vae.units[{i}]."
            if not isinstance(unit, dict):
                self.fail(f"vae.units[{i}]", "must be an object with name and ms")
            name = self.get(unit, "name", str, where)
            if not 0 < len(name) <= 100:
                self.fail(f"{where}name", "must be 1..100 characters")
            out.append((name, self.ms(unit, "ms", where)))
        return out
