"""The memory plan of a calibration run, from the model's config alone (a meta-device model: no weights read): bytes
per device for weights, activations at --seq-len × --batch-size, float64 accumulators and the held-out samples, the
device map that `--device-map auto` will load with, and a refusal with the numbers when the run will not fit.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from ..errors import SettingError, literal

GiB = 2**30
ACTIVATION_MARGIN = 1.25  # allocator rounding and fragmentation on top of the tensors counted below
CUDA_RESERVE = 512 * 2**20  # per GPU: cuBLAS workspaces, caching-allocator slack
N_ACCUMULATORS = 4  # key, weighted value, softmax value, and the finished key target held during pass 2
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
          "tib": 2**40}


def parse_max_memory(text: str | None) -> dict[int | str, int]:
    """`0=70GiB,1=70GiB,cpu=200GiB` → {0: bytes, 1: bytes, "cpu": bytes} (accelerate's max_memory form)."""
    if not text:
        return {}
    out: dict[int | str, int] = {}
    for part in text.split(","):
        key, _, size = part.strip().partition("=")
        key, size = key.strip().lower(), size.strip().lower().replace(" ", "")
        number = size.rstrip("abcdefghijklmnopqrstuvwxyz")
        unit = size[len(number):] or "b"
        if not key or unit not in _UNITS or not number:
            raise SettingError("max_memory", f"{{max_memory}}: cannot read {literal(repr(part.strip()))}",
                             "use DEVICE=SIZE pairs separated by commas, e.g. 0=70GiB,1=70GiB,cpu=200GiB")
        try:
            value = int(float(number) * _UNITS[unit])
        except ValueError:
            raise SettingError("max_memory", f"{{max_memory}}: {literal(repr(number))} is not a number") from None
        device = int(key.removeprefix("cuda:")) if key.removeprefix("cuda:").isdigit() else key
        if device == "disk":
            raise SettingError("max_memory", "{max_memory}: `disk` takes no budget (offloaded weights use the free "
                               "space of {offload_folder})", "use GPU indices (0, 1, …) and `cpu`")
        if device != "cpu" and not isinstance(device, int):
            raise SettingError("max_memory", f"{{max_memory}}: unknown device {literal(repr(key))}",
                               "use GPU indices (0, 1, …) and `cpu`")
        out[device] = value
    return out


def host_available() -> int:
    """Bytes of host memory available now (MemAvailable, else free pages)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def budgets(max_memory: dict[int | str, int]) -> dict[str, int]:
    """Memory per device: free memory of every visible GPU and available host memory, capped by --max-memory."""
    found: dict[str, int] = {"cpu": host_available()}
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            found[f"cuda:{i}"] = torch.cuda.mem_get_info(i)[0]
    for key, value in max_memory.items():
        name = f"cuda:{key}" if isinstance(key, int) else key
        if name.startswith("cuda:") and name not in found:
            raise SettingError("max_memory", f"{{max_memory}} names GPU {key} but {len(found) - 1} GPUs are visible")
        if name != "disk":
            found[name] = value if name == "cpu" else min(value, found[name])
    return found


@dataclass(frozen=True)
class DeviceNeed:
    device: str
    weights: int = 0
    activations: int = 0
    accumulators: int = 0
    heldout: int = 0
    budget: int | None = None  # None: unlimited (disk)

    @property
    def total(self) -> int:
        return self.weights + self.activations + self.accumulators + self.heldout

    @property
    def fits(self) -> bool:
        return self.budget is None or self.total <= self.budget

    def describe(self) -> str:
        parts = [f"{name} {_gib(v)}" for name, v in (("weights", self.weights), ("activations", self.activations),
                 ("accumulators", self.accumulators), ("held-out samples", self.heldout)) if v]
        limit = "unlimited" if self.budget is None else f"{_gib(self.budget)} available"
        return f"{self.device}: {' + '.join(parts) or 'nothing'} = {_gib(self.total)} ({limit})"


@dataclass(frozen=True)
class MemoryPlan:
    needs: list[DeviceNeed]
    device_map: dict[str, int | str] | None = None  # what --device-map loads with (None: one device)
    notes: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return all(n.fits for n in self.needs)

    def check(self) -> None:
        """Raise SettingError (InputError, exit 2) naming every device that is short, with its numbers."""
        short = [n.describe() for n in self.needs if not n.fits]
        if short:
            raise SettingError(
                "batch_size", "calibration will not fit in memory: " + literal("; ".join(short)),
                "lower {batch_size} or {seq_len}, use {device_map} auto (with {max_memory} and {offload_folder} "
                "to offload to CPU and disk), or {accumulate_on} cpu",
            )


def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB / 100 else f"{n / 2**20:.2f} MiB"


def meta_model(config, dtype: torch.dtype) -> torch.nn.Module:
    """The model's module tree on the meta device: shapes and names, no memory, no weights read."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


def activation_bytes(config, info, batch_size: int, seq_len: int, dtype: torch.dtype) -> int:
    """Peak working set of one decoder layer's prefill forward with capture, counted generously: residual stream and
    norms, q/k/v projections with their RoPE'd copies and the attention output, the MLP's gate/up/product, a boolean
    causal mask, and the capture's grouped copy plus its float64 image."""
    e = torch.finfo(dtype).bits // 8
    BT, hidden = batch_size * seq_len, config.hidden_size
    inter = getattr(config, "intermediate_size", None) or 4 * hidden
    H_q, H_kv, D = info.num_q_heads, info.num_kv_heads, info.head_dim
    tensors = BT * e * (3 * hidden + 3 * (H_q + H_kv) * D + 3 * inter) + BT * H_q * D * (e + 8)
    mask = batch_size * seq_len * seq_len
    return int(ACTIVATION_MARGIN * (tensors + mask))


def accumulator_bytes(info) -> int:
    L, H, D = info.num_layers, info.num_kv_heads, info.head_dim
    return N_ACCUMULATORS * L * H * (D * D + 1) * 8


def heldout_bytes(info, heldout_tokens: int, dtype: torch.dtype) -> int:
    """The clip search's held-out q, k, v of every layer, kept on the host."""
    e = torch.finfo(dtype).bits // 8
    return heldout_tokens * info.num_layers * (info.num_q_heads + 2 * info.num_kv_heads) * info.head_dim * e


def plan(config, info, *, dtype: torch.dtype, device: torch.device, batch_size: int, seq_len: int,
         heldout_tokens: int, accumulate_on: str = "model", device_map: str | None = None,
         max_memory: dict[int | str, int] | None = None, offload: bool = False, replicas: int = 1) -> MemoryPlan:
    """Bytes each device will hold during calibration. `device_map` None: the whole model on `device`; `auto`,
    `balanced` or `sequential`: the layers spread over the GPUs (then CPU, then disk when `offload`) in the space left
    after each device's activations and accumulators. `replicas`: data-parallel processes sharing this host's RAM."""
    model = meta_model(config, dtype)
    avail = budgets(max_memory or {})
    act, acc = activation_bytes(config, info, batch_size, seq_len, dtype), accumulator_bytes(info)
    held = heldout_bytes(info, heldout_tokens, dtype)
    if device_map is None:
        name = "cpu" if device.type == "cpu" else f"cuda:{device.index or 0}"
        if name not in avail:
            raise SettingError("device", f"device {name} is not visible", "pick a visible device with {device}")
        acc_on = "cpu" if accumulate_on == "cpu" else name
        rows = {name: DeviceNeed(name, weight_bytes(model) * replicas, act * replicas,
                                 acc * replicas if acc_on == name else 0, held if name == "cpu" else 0,
                                 avail[name] - (CUDA_RESERVE if name != "cpu" else 0))}
        if name != "cpu":
            rows["cpu"] = DeviceNeed("cpu", 0, 0, acc if acc_on == "cpu" else 0, held, avail["cpu"])
        return MemoryPlan(list(rows.values()))
    return _plan_device_map(model, avail, device_map, act, acc, held, accumulate_on, offload, dtype)


def _plan_device_map(model, avail: dict[str, int], mode: str, act: int, acc: int, held: int, accumulate_on: str,
                     offload: bool, dtype: torch.dtype) -> MemoryPlan:
    from accelerate.utils import compute_module_sizes, get_balanced_memory, infer_auto_device_map

    gpus = sorted((k for k in avail if k.startswith("cuda:")), key=lambda k: int(k.split(":")[1]))
    first = gpus[0] if gpus else "cpu"
    acc_on = "cpu" if accumulate_on == "cpu" else first
    # Room for weights = budget − what the run itself needs there (activations on every device that computes a layer
    # — the CPU computes offloaded layers —, accumulators on theirs, held-out samples on the host).
    room: dict[int | str, int] = {}
    for g in gpus:
        room[int(g.split(":")[1])] = max(avail[g] - CUDA_RESERVE - act - (acc if acc_on == g else 0), 0)
    room["cpu"] = max(avail["cpu"] - held - act - (acc if acc_on == "cpu" else 0), 0)
    no_split = list(getattr(model, "_no_split_modules", None) or [])
    if mode in ("auto", "balanced") and len(gpus) > 1:
        room = get_balanced_memory(model, max_memory=room, no_split_module_classes=no_split, dtype=dtype)
    device_map = infer_auto_device_map(model, max_memory=room, no_split_module_classes=no_split, dtype=dtype)
    sizes = compute_module_sizes(model, dtype=dtype)
    per_device: dict[str, int] = {}
    for module, where in device_map.items():
        name = f"cuda:{where}" if isinstance(where, int) else str(where)
        per_device[name] = per_device.get(name, 0) + sizes[module]
    computes = {n for n in per_device if n != "disk"} | ({"cpu"} if "disk" in per_device else set())
    needs = [DeviceNeed(d, per_device.get(d, 0), act if d in computes else 0, acc if d == acc_on else 0,
                        held if d == "cpu" else 0, avail[d] - (CUDA_RESERVE if d != "cpu" else 0))
             for d in [*gpus, "cpu"]]
    notes = []
    if "disk" in per_device:
        needs.append(DeviceNeed("disk", per_device["disk"]))
        if not offload:
            raise SettingError(
                "offload_folder", literal(f"the weights do not fit in GPU and host memory: {_gib(per_device['disk'])} "
                                          f"would go to disk ({'; '.join(n.describe() for n in needs[:-1])})"),
                "pass {offload_folder} DIR to offload them to disk (slow), or raise {max_memory}",
            )
        notes.append(f"{_gib(per_device['disk'])} of weights offloaded to disk: every batch reads them back")
    return MemoryPlan(needs, device_map, notes)
