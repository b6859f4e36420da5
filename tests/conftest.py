"""Project-wide test set-up: offline hubs, tests marked `gpu` skipped without CUDA, and shared model fixtures
(random-weight models of real architectures built from configs, and the real bundled SmolLM2)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing in the tests downloads
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import importlib  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

# Under pytest-xdist (`make test` runs two workers) each worker gets its share of the cores for torch's intra-op
# threads, and so do the processes the tests start. With torch's default (every core per worker) two workers on two
# cores oversubscribe them, and OpenMP's waiting threads made the two real-SmolLM2 needle tests run side by side take
# 137 s each against 29 s with one thread per worker (measured on a 2-core AVX2 machine).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
if _WORKERS > 1:
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    _threads = max(1, _cores // _WORKERS)
    os.environ["OMP_NUM_THREADS"] = str(_threads)
    torch.set_num_threads(_threads)

# Triton decides at decoration time whether a @triton.jit function is interpreted -- its own `tl.zeros` & co. too, when
# `triton.language` is first imported. So on CPU-only machines triton and every kernel module are imported here, first
# and in interpreter mode; then the variable is restored, so ops fall back to the reference unless a test (the `device`
# fixture of the kernel tests) sets TRITON_INTERPRET=1 again.
INTERPRETER = not torch.cuda.is_available() and importlib.util.find_spec("triton") is not None
if INTERPRETER:
    _saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        importlib.import_module("triton.language")
        for _kernel in ("quantize_pack", "decode", "merge"):
            importlib.import_module(f"oscar_zoo.runtime.kernels.{_kernel}")
    finally:
        if _saved is None:
            os.environ.pop("TRITON_INTERPRET")
        else:
            os.environ["TRITON_INTERPRET"] = _saved


def _patch_the_language_once_per_launch() -> None:
    """Triton's interpreter patches `triton.language` (inspect.getmembers over its modules) at every launch, which is
    needed, and again at every call of one @triton.jit function from another inside that launch, which changes nothing
    (the launch's patch is in force and its restore undoes both). The repeats were a third of a model-level
    interpreter test's time (cProfile: 28 of 83 s in `_patch_builtin` for one static-step test). Here a nested call
    skips the patch when the launch has already patched every language module the callee sees; anything else goes
    through Triton's own code."""
    interpreter = importlib.import_module("triton.runtime.interpreter")
    patch, launch = getattr(interpreter, "_patch_lang", None), getattr(interpreter, "GridExecutor", None)
    if patch is None or launch is None:  # another Triton's interpreter: its own code, unchanged
        return
    lang = importlib.import_module("triton.language")
    in_force: list[set[int]] = []  # the language modules the running launch patched (empty outside a launch)
    run = launch.__call__

    def langs(fn) -> set[int]:
        return {id(v) for v in getattr(fn, "__globals__", {}).values() if v is lang or v is lang.core}

    class _Nothing:
        def restore(self) -> None:
            pass

    def patch_lang(fn):
        seen = langs(fn)
        if in_force and in_force[-1] and seen and seen <= in_force[-1]:
            return _Nothing()
        scope = patch(fn)  # (Triton's own check: a function that sees no language module is an error)
        if in_force:
            in_force[-1] |= seen
        return scope

    def grid_call(self, *args, **kwargs):
        in_force.append(set())
        try:
            return run(self, *args, **kwargs)
        finally:
            in_force.pop()

    interpreter._patch_lang = patch_lang
    launch.__call__ = grid_call


if INTERPRETER:
    _patch_the_language_once_per_launch()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


TINY = dict(hidden_size=192, intermediate_size=256, num_hidden_layers=2, num_attention_heads=6,
            num_key_value_heads=2, head_dim=64, vocab_size=512, max_position_embeddings=4096)


def tiny_config(model_type: str = "llama", **overrides):
    """A small config of a real architecture (GQA group 3, head_dim 64) with random weights to come."""
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **{**TINY, **overrides})


def tiny_model(model_type: str = "llama", seed: int = 0, dtype=torch.float32, **overrides):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides), dtype=dtype)
    return model.eval()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A random-weight Llama saved as a local folder, with a real tokenizer (the bundled SmolLM2's, vocab 49152)."""
    from transformers import AutoTokenizer

    from oscar_zoo.models import ensure_demo_model

    folder = tmp_path_factory.mktemp("tiny-llama")
    tokenizer = AutoTokenizer.from_pretrained(ensure_demo_model())
    tiny_model("llama", vocab_size=len(tokenizer)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def smollm2():
    """The real pretrained demo model in float32 on every CPU (converted once into the oscar-zoo cache and reused):
    bfloat16 is several times slower than float32 on CPUs without native bfloat16, and no test of it needs bfloat16."""
    from oscar_zoo.models import load_model

    return load_model("demo", device="cpu", dtype="float32")


@pytest.fixture
def run_cli(capsys, monkeypatch):
    """Run `oscar-zoo ARGS` in-process through the real entry point (error boundary included); returns
    (exit code, stdout, stderr)."""
    import sys

    from oscar_zoo.cli import main

    def run(*args: str):
        monkeypatch.setattr(sys, "argv", ["oscar-zoo", *map(str, args)])
        code = 0
        try:
            main()
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        out, err = capsys.readouterr()
        return code, out, err

    return run


@pytest.fixture(scope="module")
def play_text(tmp_path_factory):
    """20,000 characters of a bundled play as a local text file (verify's --dataset in the command tests)."""
    from oscar_zoo.texts import corpus_dir

    path = tmp_path_factory.mktemp("text") / "henry_v.txt"
    path.write_text((corpus_dir() / "henry_v_gut.txt").read_text()[:20000])
    return path


@pytest.fixture
def verify_loads_no_model(monkeypatch):
    """verify must refuse before it reaches the model: loading it fails the test loudly."""
    from oscar_zoo.evaluation import verification_run

    def refuse(*args, **kwargs):
        raise AssertionError("verify loaded the model before checking its options")

    monkeypatch.setattr(verification_run, "load_model", refuse)
