"""Fuzzing the inputs oscar-zoo reads from others: malformed manifests, malformed `rotations.safetensors`
(re-checksummed so that validation, not the sha256 check, must catch them) and malformed reference `.pt` files.

Every case is invalid by construction. Through the CLI (in process, the real error boundary) each must exit 2 or 4 with
one `error:` line (plus at most a `hint:` line), no traceback and nothing written; values that would poison a runtime
(NaN/Inf, clips outside (0, 1], non-orthogonal rotations) must be exit 4. `OscarCache.from_folder` may build a cache
from what it does not read (most of the manifest) but otherwise raises ValueError, never another exception, and always
for poisoned values. Seeded: the same cases every run (about 20 s on 2 cores).
"""

from __future__ import annotations

import copy
import io
import json
import random
import struct
import typing
from pathlib import Path

import torch
from safetensors.torch import load_file, save

from oscar_zoo.format.records import Record
from oscar_zoo.format.schema import Manifest
from oscar_zoo.runtime.cache import OscarCache

from .hub.helpers import make_artifacts, random_rotations, rewrite_rotations, run_cli

SEED = 16
L, H_KV, D = 2, 2, 16


def _check_cli(args: list, name: str, poison: bool, failures: list[str], out: Path | None = None) -> None:
    try:
        code, stdout, err = run_cli(*map(str, args))
    except Exception as exc:  # noqa: BLE001 -- escaped the error boundary: a traceback for the user
        failures.append(f"{name}: {args[0]}: {type(exc).__name__} escaped: {str(exc)[:200]}")
        return
    lines = err.strip().splitlines()
    problems = []
    if code not in ((4,) if poison else (2, 4)):
        problems.append(f"exit {code}")
    if "Traceback" in err or not lines or not lines[0].startswith("error: "):
        problems.append("no one-line error")
    elif len(lines) > 2 or (len(lines) == 2 and not lines[1].startswith("hint: ")):
        problems.append(f"{len(lines)} lines on stderr")
    if out is not None and out.exists():
        problems.append(f"{out.name} was written")
    if problems:
        failures.append(f"{name}: {args[0]}: {', '.join(problems)}: {err.strip()[:300]!r}")


def _check_runtime(folder: Path, name: str, poison: bool, failures: list[str]) -> None:
    try:
        OscarCache.from_folder(folder)
    except ValueError:
        return
    except Exception as exc:  # noqa: BLE001 -- the point: any other exception type is a finding
        failures.append(f"{name}: from_folder raised {type(exc).__name__}: {str(exc)[:200]}")
        return
    if poison:
        failures.append(f"{name}: from_folder accepted poisoned values")


# -- manifests --------------------------------------------------------------------------------------------------------
def _required_paths(model: type[Record], doc: dict, prefix: tuple = ()) -> list[tuple]:
    """Paths of every key the schema requires (dropping one must fail), descending into nested records and lists."""
    paths = []
    required = set(model.required())
    for key, ann in model.field_types().items():
        if key not in doc:
            continue
        if key in required:
            paths.append((*prefix, key))
        inner = typing.get_args(ann)[0] if typing.get_origin(ann) is list else ann
        if isinstance(inner, type) and issubclass(inner, Record):
            value = doc[key]
            for i, item in enumerate(value if isinstance(value, list) else [value]):
                sub = (*prefix, key, i) if isinstance(value, list) else (*prefix, key)
                paths += _required_paths(inner, item, sub)
    return paths


def _typed_leaves(doc, prefix=()) -> list[tuple]:
    """Paths of leaves outside the free-form verification report (whose values the schema does not type)."""
    if prefix[:1] == ("verification",):
        return []
    if isinstance(doc, dict):
        return [p for k, v in doc.items() for p in _typed_leaves(v, (*prefix, k))]
    if isinstance(doc, list) and doc:
        return [p for i, v in enumerate(doc) for p in _typed_leaves(v, (*prefix, i))]
    return [prefix]


def _set(doc, path, value):
    doc = copy.deepcopy(doc)
    node = doc
    for p in path[:-1]:
        node = node[p]
    if value is _DROP:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return doc


_DROP = object()
CONSTRAINED = [("model", "num_layers"), ("model", "num_q_heads"), ("model", "num_kv_heads"), ("model", "head_dim"),
               ("quant", "group_size"), ("quant", "flush"), ("quant", "sink"), ("quant", "recent"),
               ("artifacts", 0, "bytes"), ("rotation", "layer_ids", 0)]


def _manifest_cases(good: str, rng: random.Random) -> list[tuple[str, bytes]]:
    doc = json.loads(good)
    dump = lambda d: json.dumps(d, indent=1).encode()  # noqa: E731
    cases = []
    for path in rng.sample(_required_paths(Manifest, doc), 14):
        cases.append((f"drop {'.'.join(map(str, path))}", dump(_set(doc, path, _DROP))))
    leaves = _typed_leaves(doc)
    for path in rng.sample(leaves, 14):
        wrong = rng.choice([[[]], {"a": [[]]}, None if path[-1] not in ("revision", "rope_theta") else [[]]])
        cases.append((f"wrong type at {'.'.join(map(str, path))}", dump(_set(doc, path, wrong))))
    for path in rng.sample(leaves, 8):  # non-JSON constants and numbers out of range anywhere, even in free text
        token = rng.choice(["NaN", "Infinity", "-Infinity", "1e400", "-2e308", str(2**70), "9" * 5000])
        text = dump(_set(doc, path, "@@")).decode().replace('"@@"', token)
        cases.append((f"{token[:12]} at {'.'.join(map(str, path))}", text.encode()))
    for path in CONSTRAINED:
        value = rng.choice([-1, 0, -(2**40)]) if path[-1] not in ("sink", "recent", 0) else -rng.randint(1, 99)
        if path[:2] == ("rotation", "layer_ids"):
            value = rng.choice([-1, 10**6, doc["model"]["num_layers"]])
        cases.append((f"{value} at {'.'.join(map(str, path))}", dump(_set(doc, path, value))))
    for bad in ["../rotations.safetensors", "/etc/passwd", "sub/rotations.safetensors", "rotations.safetensors\0",
                "", "manifest.json", "ROTATIONS.SAFETENSORS"]:
        cases.append((f"path {bad!r}", dump(_set(doc, ("artifacts", 0, "path"), bad))))
    cases.append(("file listed twice", dump(_set(doc, ("artifacts",), doc["artifacts"] * 2))))
    cases.append(("sha256 of another file", dump(_set(doc, ("artifacts", 0, "sha256"), "0" * 64))))
    cases.append(("bytes off by one", dump(_set(doc, ("artifacts", 0, "bytes"), doc["artifacts"][0]["bytes"] + 1))))
    cases.append(("schema_version 6", dump(_set(doc, ("schema_version",), 6))))
    cases.append(("schema_version true", dump(_set(doc, ("schema_version",), True))))
    cases.append(("centring in a version-1 manifest", dump(_set(_set(doc, ("schema_version",), 1),
                                                                ("quant", "centring"), "none"))))
    cases.append(("centred manifest, tensors without means", dump(_set(doc, ("quant", "centring"), "mean"))))
    cases.append(("unknown centring", dump(_set(doc, ("quant", "centring"), "median"))))
    cases.append(("key_bits in a version-2 manifest", dump(_set(_set(doc, ("schema_version",), 2),
                                                                 ("quant", "key_bits"), [2, 3]))))
    cases.append(("4-bit keys", dump(_set(doc, ("quant", "key_bits"), [4, 2]))))
    cases.append(("pin in a version-3 manifest", dump(_set(_set(doc, ("schema_version",), 3), ("quant", "pin"), 32))))
    cases.append(("key_block in a version-4 manifest", dump(_set(_set(doc, ("schema_version",), 4),
                                                                 ("quant", "key_block"), 64))))
    for block in (48, 0, -64, 64.0, "64", True):  # not a block size; or (64) a flush, group size that cannot hold it
        cases.append((f"key_block {block!r}", dump(_set(doc, ("quant", "key_block"), block))))
    cases.append(("negative pin", dump(_set(doc, ("quant", "pin"), -1))))
    cases.append(("pin past the window limit", dump(_set(doc, ("quant", "pin"), 2**21))))
    cases.append(("pin as a string", dump(_set(doc, ("quant", "pin"), "32"))))
    cases.append(("key_bits for one of two layers", dump(_set(doc, ("quant", "key_bits"), [3]))))
    cases.append(("key_bits as a string", dump(_set(doc, ("quant", "key_bits"), "3"))))
    cases.append(("unknown key", dump(_set(doc, ("model", "surprise"), 1))))
    cases.append(("markup key", dump(_set(doc, ("[/]",), 1))))
    cases.append(("duplicate layer ids", dump(_set(doc, ("rotation", "layer_ids"), [0, 0]))))
    cases.append(("no layer ids", dump(_set(doc, ("rotation", "layer_ids"), []))))
    raw = good.replace('"test"', '"t\u00e9st \u2713"')
    for enc in ["latin-1", "utf-16", "utf-32", "cp1252"]:
        cases.append((f"encoded {enc}", raw.encode(enc, errors="replace")))
    utf8 = raw.encode()
    cases += [("random bytes", rng.randbytes(300)), ("truncated multibyte", utf8[: utf8.index("✓".encode()) + 1]),
              ("overlong UTF-8", utf8.replace(b"/", b"\xc0\xaf", 1) if b"/" in utf8 else b"\xc0\xaf" + utf8),
              ("UTF-8 surrogate", utf8.replace("✓".encode(), b"\xed\xa0\x80")), ("NUL bytes", b"\0" * 64),
              ("JSON surrogate escape", good.replace('"test"', '"\\udc80"').encode()), ("BOM", b"\xef\xbb\xbf" + utf8),
              ("empty", b""), ("truncated", utf8[: rng.randrange(1, len(utf8) - 1)]), ("a list", b"[1, 2]"),
              ("deep array", b"[" * 100_000 + b"]" * 100_000),
              ("deep object", b'{"a":' * 50_000 + b"1" + b"}" * 50_000),
              ("deep in verification", dump(_set(doc, ("verification",), _nest(rng.randint(40, 400))))),
              ("deep in versions", dump(_set(doc, ("calibration", "versions", "x"), _nest(60)))),
              ("too big", dump(_set(doc, ("calibration", "dataset"), "x" * (1 << 21))))]
    return cases


def _nest(depth: int):
    node: object = 1
    for _ in range(depth):
        node = {"a": node}
    return node


def test_fuzzed_manifests(tmp_path):
    rng = random.Random(SEED)
    folder = tmp_path / "art"
    make_artifacts(folder, L=L, H_kv=H_KV, D=D)
    good = (folder / "manifest.json").read_text()
    failures: list[str] = []
    cases = _manifest_cases(good, rng)
    assert len(cases) >= 80
    for name, data in cases:
        (folder / "manifest.json").write_bytes(data)
        _check_cli(["inspect", folder], name, False, failures)
        _check_runtime(folder, name, False, failures)
    for name, data in rng.sample(cases, 20):  # export reads through the same loader: a sample
        (folder / "manifest.json").write_bytes(data)
        _check_cli(["export", folder, "--format", "sglang", "--out", tmp_path / "sg"], name, False, failures,
                   tmp_path / "sg")
    assert not failures, "\n".join(failures)


# -- rotations.safetensors --------------------------------------------------------------------------------------------
FLOATS = ("k_rotation", "v_rotation", "k_eigenvalues", "v_eigenvalues", "k_clip", "v_clip")


def _poke(t: dict, name: str, rng: random.Random, value: float) -> dict:
    x = t[name].clone()
    flat = x.view(-1)
    flat[rng.randrange(flat.numel())] = value
    return {**t, name: x}


def _tensor_cases(t: dict, raw: bytes, rng: random.Random) -> list[tuple[str, bytes, bool]]:
    """(name, file bytes, poisoned) -- poisoned: values a runtime must never use."""
    cases = []
    for _ in range(10):
        name, value = rng.choice(FLOATS), rng.choice([float("nan"), float("inf"), float("-inf")])
        cases.append((f"{value} in {name}", save(_poke(t, name, rng, value)), True))
    for _ in range(8):
        name, value = rng.choice(["k_clip", "v_clip"]), rng.choice([0.0, -0.3, 1.0 + rng.random(), 1e30, -1e-9])
        cases.append((f"{name} {value}", save(_poke(t, name, rng, value)), True))
    for _ in range(10):
        name, layer = rng.choice(["k_rotation", "v_rotation"]), rng.randrange(L)
        M = t[name].clone()
        how = rng.choice(["scaled", "gaussian", "zeros", "perturbed", "sheared"])
        spoil = {"scaled": lambda m: m * (1 + rng.choice([1e-3, 0.05, -0.5, 9.0])),
                 "gaussian": lambda m: torch.randn(D, D),
                 "zeros": torch.zeros_like,
                 "perturbed": lambda m: m + 1e-3,
                 "sheared": lambda m: m @ (torch.eye(D) + 0.01 * torch.triu(torch.ones(D, D), 1))}[how]
        M[layer, 0] = spoil(M[layer, 0])
        cases.append((f"{how} {name}[{layer}]", save({**t, name: M}), True))
    for name in rng.sample(list(t), 4):
        dtype = rng.choice([torch.float16, torch.bfloat16, torch.float64] if name != "layer_ids"
                           else [torch.int64, torch.float32, torch.int16])
        cases.append((f"{name} as {dtype}", save({**t, name: t[name].to(dtype)}), False))
    cases += [
        (f"without {n}", save({k: v for k, v in t.items() if k != n}), False) for n in rng.sample(list(t), 3)]
    cases += [("extra tensor", save({**t, "k_scale": torch.ones(L)}), False),
              ("layer missing everywhere", save({k: v[:1].contiguous() for k, v in t.items()}), False),
              ("clip [L]", save({**t, "k_clip": t["k_clip"][:, 0].contiguous()}), False),
              ("one V head", save({**t, "v_rotation": t["v_rotation"][:, :1].contiguous()}), False),
              ("rotation [L, H, D]", save({**t, "k_rotation": t["k_rotation"][..., 0].contiguous()}), False),
              ("rotation non-square", save({**t, "k_rotation": t["k_rotation"][..., :-4].contiguous()}), False),
              ("layer_ids duplicated", save({**t, "layer_ids": torch.zeros(L, dtype=torch.int32)}), False),
              ("layer_ids negative", save({**t, "layer_ids": -torch.arange(1, L + 1, dtype=torch.int32)}), False),
              ("layer_ids [L, 1]", save({**t, "layer_ids": t["layer_ids"][:, None].contiguous()}), False),
              ("no tensors", save({}), False)]
    header_len = struct.unpack("<Q", raw[:8])[0]
    for n in sorted(rng.sample(range(len(raw)), 6)) + [0, 7, 8, 8 + header_len]:
        cases.append((f"truncated to {n} bytes", raw[:n], False))
    for length in [2**62, 2**32, 1 << 27, len(raw), header_len + 1, 1]:
        cases.append((f"header length {length}", struct.pack("<Q", length) + raw[8:], False))
    header = raw[8 : 8 + header_len]
    cases += [("header not JSON", raw[:8] + b"{" * header_len + raw[8 + header_len :], False),
              ("header not UTF-8", raw[:8] + b"\xff" * header_len + raw[8 + header_len :], False),
              ("offsets past the end", raw[:8] + header.replace(b'"data_offsets":[0,', b'"data_offsets":[9,', 1)
               + raw[8 + header_len :], False),
              ("payload cut short", raw[:-64], False),
              ("unknown dtype", raw[:8] + header.replace(b'"F32"', b'"X99"', 1) + raw[8 + header_len :], False)]
    return cases


def test_fuzzed_safetensors(tmp_path):
    rng = random.Random(SEED + 1)
    torch.manual_seed(SEED)
    folder = tmp_path / "art"
    make_artifacts(folder, L=L, H_kv=H_KV, D=D)
    raw = (folder / "rotations.safetensors").read_bytes()
    manifest = (folder / "manifest.json").read_bytes()
    t = load_file(str(folder / "rotations.safetensors"))
    failures: list[str] = []
    cases = _tensor_cases(t, raw, rng)
    assert len(cases) > 60
    for i, (name, data, poison) in enumerate(cases):
        assert data != raw, name
        (folder / "manifest.json").write_bytes(manifest)
        rewrite_rotations(folder, raw=data)
        _check_cli(["inspect", folder], name, poison, failures)
        if poison or i % 3 == 0:
            _check_cli(["export", folder, "--format", "sglang", "--out", tmp_path / "sg"], name, poison, failures,
                       tmp_path / "sg")
        _check_runtime(folder, name, poison, failures)
    assert not failures, "\n".join(failures)


# -- reference .pt files ----------------------------------------------------------------------------------------------
K_OBJ, V_OBJ = "qqt_r_h_pbr", "sst_r_h_pbr"


def _pt(objective: str, seed: int) -> dict:
    R = random_rotations(L, 1, D, seed=seed)[:, 0]
    return {"format_version": 1, "objective": objective, "source_grouping": "layer",
            "layers": {i: {"layer_id": i, "rotation": R[i].contiguous(), "eigenvalues": torch.arange(D) / D}
                       for i in range(L)}}


def _saved(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _pt_cases(rng: random.Random) -> list[tuple[str, object, bool]]:
    """(name, a mutated dict or raw bytes, poisoned)."""
    base = _pt(K_OBJ, 1)

    def layer(d):
        return d["layers"][rng.randrange(L)]

    def mutate(name, fn, poison=False):
        d = copy.deepcopy(base)
        fn(d)
        cases.append((name, d, poison))

    cases: list[tuple[str, object, bool]] = []
    for value in [[1, 2], "layers", 7, None, torch.eye(D), (base,)]:
        cases.append((f"top level {type(value).__name__}", value, False))
    for key in ["layers", "objective"]:
        for value in [None, [[]], 3, torch.zeros(1), {}]:
            if key == "objective" and value is None:
                continue
            mutate(f"{key} = {value!r}"[:40], lambda d, k=key, v=value: d.__setitem__(k, v))
    for value in [0, 2, "1", 1.0, True, None]:
        mutate(f"format_version {value!r}", lambda d, v=value: d.__setitem__("format_version", v))
    mutate("objective of V", lambda d: d.__setitem__("objective", V_OBJ))
    mutate("objective vtv", lambda d: d.__setitem__("objective", "vtv_plain"))
    mutate("source_grouping head", lambda d: d.__setitem__("source_grouping", "head"))
    for key in ["x", -1, 1.5, "1.5", "-1", None, (0,), "\u0663", True]:
        mutate(f"layer key {key!r}", lambda d, k=key: d["layers"].__setitem__(k, d["layers"].pop(0)))
    mutate("keys 0 and '0'", lambda d: d["layers"].__setitem__("0", d["layers"][0]))
    mutate("keys 1 and '01'", lambda d: d["layers"].__setitem__("01", d["layers"][1]))
    for value in [None, [[1.0]], "eye", torch.ones(D), torch.ones(D, D, 1), torch.ones(D, D + 1),
                  torch.ones(0, 0), torch.eye(D, dtype=torch.int32), torch.eye(D, dtype=torch.bool),
                  torch.eye(D, dtype=torch.complex64), torch.eye(D).to_sparse(), torch.eye(8)]:
        mutate(f"rotation {value!r}"[:40], lambda d, v=value: layer(d).__setitem__("rotation", v))
    for value in [[0.0] * D, torch.ones(D + 1), torch.ones(D, 1), torch.ones(D, dtype=torch.int64), "λ"]:
        mutate(f"eigenvalues {value!r}"[:40], lambda d, v=value: layer(d).__setitem__("eigenvalues", v))
    for value in [L + 3, "0", 0.0, torch.ones(2), None, -1]:
        mutate(f"layer_id {value!r}"[:40], lambda d, v=value: d["layers"][1].__setitem__("layer_id", v))
    mutate("entry a tensor", lambda d: d["layers"].__setitem__(1, torch.eye(D)))
    mutate("entry a list", lambda d: d["layers"].__setitem__(1, [torch.eye(D)]))
    mutate("a layer missing", lambda d: d["layers"].pop(L - 1))
    mutate("a layer beyond the model", lambda d: d["layers"].__setitem__(L, copy.deepcopy(d["layers"][0])))
    mutate("head dim 8", lambda d: d.__setitem__("layers", {i: {"rotation": torch.eye(8)} for i in range(L)}))
    for _ in range(10):
        value = rng.choice([float("nan"), float("inf"), float("-inf")])
        mutate(f"{value} in a rotation", lambda d, v=value: layer(d)["rotation"].view(-1).__setitem__(
            rng.randrange(D * D), v), poison=True)
    for factor in [1.0 + 1e-3, 0.9, 2.0, 0.0, -1.5]:
        mutate(f"rotation × {factor}", lambda d, f=factor: layer(d).__setitem__("rotation", layer(d)["rotation"] * f),
               poison=True)
    mutate("Gaussian rotation", lambda d: layer(d).__setitem__("rotation", torch.randn(D, D)), poison=True)
    mutate("rotation plus 1e-3", lambda d: layer(d).__setitem__("rotation", layer(d)["rotation"] + 1e-3),
           poison=True)
    mutate("NaN eigenvalues", lambda d: layer(d).__setitem__("eigenvalues", torch.full((D,), float("nan"))),
           poison=True)
    good = _saved(base)
    cases += [("text", b"rotation = [[1, 0], [0, 1]]\n", False), ("empty", b"", False),
              ("random bytes", rng.randbytes(2000), False), ("JSON", json.dumps({"layers": {}}).encode(), False),
              ("garbage before the zip", b"JUNK" + good, False), ("zip signature broken", b"XK" + good[2:], False)]
    cases += [(f"truncated to {n}", good[:n], False) for n in sorted(rng.sample(range(len(good)), 8))]
    return cases


def test_fuzzed_reference_pt_files(tmp_path):
    from transformers import LlamaConfig

    rng = random.Random(SEED + 2)
    torch.manual_seed(SEED)
    model_dir = tmp_path / "model"
    LlamaConfig(hidden_size=96, intermediate_size=128, num_hidden_layers=L, num_attention_heads=6,
                num_key_value_heads=H_KV, head_dim=D, vocab_size=64).save_pretrained(model_dir)
    good = {"k": _saved(_pt(K_OBJ, 1)), "v": _saved(_pt(V_OBJ, 2))}
    out = tmp_path / "art"
    failures: list[str] = []
    cases = _pt_cases(rng)
    assert len(cases) > 90
    for name, case, poison in cases:
        side = "k" if name.startswith("objective") else rng.choice("kv")  # objective cases are K-side mistakes
        if isinstance(case, dict) and side == "v" and case.get("objective") == K_OBJ:
            case = {**case, "objective": V_OBJ}
        data = case if isinstance(case, bytes) else _saved(case)
        files = {s: tmp_path / f"{s}.pt" for s in "kv"}
        for s, path in files.items():
            path.write_bytes(data if s == side else good[s])
        _check_cli(["import-oscar", files["k"], files["v"], "--model", model_dir, "--out", out],
                   f"{name} (as {side.upper()})", poison, failures, out)
    assert not failures, "\n".join(failures)
