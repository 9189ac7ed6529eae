"""The offloading policy: FlexGen's `Policy` (flex_opt.py), with the schedule and the prefetch depth named.

A policy fixes the block schedule (how many GPU batches share one load of each layer's weights) and where each
kind of tensor lives: the weights at layer granularity (that share of every layer's tensors), the KV cache and
the activations at tensor granularity (that share of every tensor's elements), as FlexGen Section 4.2 defines
them. Percentages are of the whole; the disk tier holds the rest of each triple. The runtime (generate/schedules/zigzag.py)
holds the cache split by (sequence, KV head) rows and the activations split by token rows, between device and
host only (both on the device under the row schedule): config._check_offload refuses other values, and lp.py
never proposes them. The placement rules both check are offload/placement.py's.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from .placement import PAIRS, PERCENT_RULE, SCHEDULES, is_percent, over_100
from .tiers import place_layers


@dataclass(frozen=True)
class Policy:
    gpu_batch_size: int          # sequences computed together on the device (FlexGen's gbs)
    num_gpu_batches: int         # GPU batches per block: block size = gpu_batch_size * num_gpu_batches
    weights_gpu: float           # % of every layer's weights resident on the device
    weights_cpu: float           # % in host memory; disk holds 100 - weights_gpu - weights_cpu
    cache_gpu: float             # % of the KV cache on the device
    cache_cpu: float             # % in host memory; disk holds the rest
    act_gpu: float               # % of the activations (hidden states between layers) on the device
    act_cpu: float               # % in host memory; disk holds the rest
    cpu_attention: bool = False  # decode attention over host-resident cache runs on the host (FlexGen's CPU
                                 # delegation): only q and the attention output cross the link, not the cache
    prefetch_layers: int = 1     # layers fetched ahead of the one computing; 0 = no overlap of I/O and compute
    schedule: str = "zigzag"     # zigzag: FlexGen's block schedule (Algorithm 1), weights loaded once per block;
                                 # row: ZeRO-Inference / Accelerate, weights loaded once per GPU batch

    def __post_init__(self):
        for name in ("gpu_batch_size", "num_gpu_batches"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if isinstance(self.prefetch_layers, bool) or not isinstance(self.prefetch_layers, int) \
                or self.prefetch_layers < 0:
            raise ValueError(f"prefetch_layers must be an integer >= 0, got {self.prefetch_layers!r}")
        for gpu, cpu in PAIRS:
            for name in (gpu, cpu):
                value = getattr(self, name)
                if not is_percent(value):
                    raise ValueError(f"{name} {PERCENT_RULE}, got {value!r}")
            if over_100(getattr(self, gpu), getattr(self, cpu)):
                raise ValueError(f"{gpu} + {cpu} = {getattr(self, gpu) + getattr(self, cpu):g} must be <= 100 "
                                 f"(the disk holds the rest)")
        if not isinstance(self.cpu_attention, bool):
            raise ValueError(f"cpu_attention must be true or false, got {self.cpu_attention!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")

    @classmethod
    def from_section(cls, section, batch_size: int) -> "Policy":
        """The policy a run's `[offload]` section (config.OffloadSection) states; batch_size: its `[generate]`
        batch_size, the block, which gives the GPU batch when the section leaves gpu_batch_size = 0."""
        values = {f.name: getattr(section, f.name) for f in fields(cls)}
        values["gpu_batch_size"] = section.gpu_batch_size or max(1, batch_size // section.num_gpu_batches)
        return cls(**values)

    # -- derived values --

    @property
    def block_size(self) -> int:
        """Sequences of one block (FlexGen's bls): they share each load of a layer's weights (zig-zag)."""
        return self.gpu_batch_size * self.num_gpu_batches

    @property
    def weights_disk(self) -> float:
        return 100 - self.weights_gpu - self.weights_cpu

    @property
    def cache_disk(self) -> float:
        return 100 - self.cache_gpu - self.cache_cpu

    @property
    def act_disk(self) -> float:
        return 100 - self.act_gpu - self.act_cpu

    def fractions(self) -> dict[str, float]:
        """FlexGen's nine placement variables as fractions in [0, 1]: wg wc wd, cg cc cd, hg hc hd."""
        return {"wg": self.weights_gpu / 100, "wc": self.weights_cpu / 100, "wd": self.weights_disk / 100,
                "cg": self.cache_gpu / 100, "cc": self.cache_cpu / 100, "cd": self.cache_disk / 100,
                "hg": self.act_gpu / 100, "hc": self.act_cpu / 100, "hd": self.act_disk / 100}

    # -- output --

    def to_toml_section(self, device_memory: int | None = None, host_memory: int | None = None,
                        disk_dir: str | None = None, num_layers: int | None = None,
                        gen_len: int | None = None, profile: str | None = None) -> str:
        """The policy as an `[offload]` TOML section (budgets in bytes, when known) and the `[generate]` keys it
        was planned for (batch_size = the block; max_new_tokens = gen_len, which sizes the KV cache), ready to
        paste. disk_dir: printed when any weight is on disk (the config requires it then). num_layers: the
        weights' comments say how many whole layers each tier holds (tiers.place_layers). profile: the profile the
        plan was made with (a preset or a file), printed so that the run reports predicted against measured."""
        layers = {}
        if num_layers:
            tiers = place_layers(num_layers, self.weights_gpu, self.weights_cpu)
            layers = {t: f"{tiers.count(t)} of {num_layers} layers" for t in ("device", "host", "disk")}
        on = lambda tier: f"  # {layers[tier]}" if layers else ""
        lines = ["[offload]",
                 f'schedule = "{self.schedule}"',
                 f"gpu_batch_size = {self.gpu_batch_size}",
                 f"num_gpu_batches = {self.num_gpu_batches}            # block size {self.block_size}",
                 f"weights_gpu = {_num(self.weights_gpu)}" + on("device"),
                 f"weights_cpu = {_num(self.weights_cpu)}" + (f"  # {layers['host']}; disk: {_num(self.weights_disk)}"
                                                              f" ({layers['disk']})" if layers else
                                                              f"                # disk: {_num(self.weights_disk)}"),
                 f"cache_gpu = {_num(self.cache_gpu)}",
                 f"cache_cpu = {_num(self.cache_cpu)}                  # disk: {_num(self.cache_disk)}",
                 f"act_gpu = {_num(self.act_gpu)}",
                 f"act_cpu = {_num(self.act_cpu)}                    # disk: {_num(self.act_disk)}",
                 f"cpu_attention = {'true' if self.cpu_attention else 'false'}",
                 f"prefetch_layers = {self.prefetch_layers}"]
        for key, value in (("device_memory", device_memory), ("host_memory", host_memory)):
            if value is not None:
                lines.append(f"{key} = {int(value)}          # {human_bytes(value)}")
        if disk_dir is not None and self.weights_disk > 0:
            lines.append(f"disk_dir = {_toml_string(disk_dir)}  # where the disk layers are written")
        if profile is not None:
            lines.append(f"profile = {_toml_string(profile)}  # the run reports predicted vs measured time")
        lines += ["", "[generate]", f"batch_size = {self.block_size}  # the block: gpu_batch_size x num_gpu_batches"]
        if gen_len is not None:
            lines.append(f"max_new_tokens = {gen_len}  # the plan's --gen-len: the KV cache is sized for it")
        return "\n".join(_align_comments(lines)) + "\n"


def _toml_string(text: str) -> str:
    """A TOML basic string."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _num(value: float) -> str:
    """A percentage as TOML: an integer when it is one (20, not 20.0), else up to 2 decimals."""
    rounded = round(float(value), 2)
    return str(int(rounded)) if rounded == int(rounded) else f"{rounded:g}"


def _align_comments(lines: list[str]) -> list[str]:
    """Put every `# comment` of the section in one column."""
    split = [line.split("  #", 1) if "  #" in line else line.split(" # ", 1) if " # " in line else [line]
             for line in lines]
    width = max((len(parts[0].rstrip()) for parts in split if len(parts) == 2), default=0)
    return [parts[0] if len(parts) == 1 else f"{parts[0].rstrip():<{width}}  #{parts[1]}" for parts in split]


def human_bytes(n: float) -> str:
    """Decimal units, as budgets are usually written: 16000000000 -> "16.0 GB"."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"
