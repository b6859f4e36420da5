"""The memory plan (from the config alone) refuses a run that cannot fit, with its numbers, and accepts one that
can; a model split over CPU and disk by `--device-map auto` gives the unsplit model's targets."""


import pytest
import torch

from oscar_zoo.calibration import memory
from oscar_zoo.calibration.calibration_passes import AccumulatorStore, CalibrationSettings, accumulate
from oscar_zoo.errors import InputError
from oscar_zoo.models import arch_info, load_model
from oscar_zoo.texts import TokenSequences

from ..conftest import tiny_config, tiny_model

MiB = 2**20


def test_plan_counts_weights_activations_and_accumulators():
    config = tiny_config("llama")
    info = arch_info(config)
    plan = memory.plan(config, info, dtype=torch.float32, device=torch.device("cpu"), batch_size=2, seq_len=64,
                       heldout_tokens=64, max_memory={"cpu": 64 * MiB})
    (cpu,) = plan.needs
    n_params = sum(p.numel() for p in tiny_model("llama").parameters())
    assert abs(cpu.weights - 4 * n_params) < 4096  # + the rotary buffer
    assert cpu.accumulators == 4 * 2 * 2 * (64 * 64 + 1) * 8  # 4 float64 [L, H_kv, D, D] (+ weights)
    assert cpu.heldout == 64 * 2 * (6 + 2 * 2) * 64 * 4
    assert cpu.activations > 2 * 64 * 192 * 4 and plan.fits
    bigger = memory.plan(config, info, dtype=torch.float32, device=torch.device("cpu"), batch_size=4, seq_len=64,
                         heldout_tokens=64, max_memory={"cpu": 64 * MiB})
    assert bigger.needs[0].activations > 1.9 * cpu.activations


def test_plan_refuses_with_numbers_and_accepts_what_fits():
    config = tiny_config("llama")
    info = arch_info(config)
    kwargs = dict(dtype=torch.float32, device=torch.device("cpu"), batch_size=2, seq_len=64, heldout_tokens=64)
    memory.plan(config, info, **kwargs, max_memory={"cpu": 64 * MiB}).check()  # fits: no error
    with pytest.raises(InputError) as exc:
        memory.plan(config, info, **kwargs, max_memory={"cpu": 1 * MiB}).check()
    assert exc.value.exit_code == 2
    assert "will not fit" in exc.value.message and "weights" in exc.value.message
    assert "1.00 MiB available" in exc.value.message and exc.value.setting == "batch_size"
    assert "lower batch_size or seq_len" in exc.value.advice  # the library names settings; the command, flags
    # a device map that would need disk, without an offload folder, is refused too
    with pytest.raises(InputError, match="pass offload_folder DIR"):
        memory.plan(config, info, **kwargs, device_map="auto", max_memory={"cpu": 5 * MiB})
    assert memory.parse_max_memory("0=70GiB, cpu=1.5GB") == {0: 70 * 2**30, "cpu": 1_500_000_000}
    with pytest.raises(InputError, match="DEVICE=SIZE"):
        memory.parse_max_memory("lots")


def test_cli_refuses_before_loading_weights(run_cli, tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("OSCAR_ZOO_CACHE", str(tmp_path / "cache"))
    code, _, err = run_cli("calibrate", tiny_model_dir, "--device", "cpu", "--dtype", "float32", "--tokens", "256",
                           "--seq-len", "64", "--max-memory", "cpu=10MiB", "--out", tmp_path / "art")
    assert code == 2 and "will not fit" in err and "10.00 MiB available" in err and "Traceback" not in err
    assert "lower --batch-size or --seq-len, use --device-map auto" in " ".join(err.split())  # spelled as flags
    assert not (tmp_path / "art").exists()


def test_cpu_and_disk_split_gives_the_unsplit_targets(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    folder = tmp_path / "model"
    tiny_model("llama", num_hidden_layers=4).save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(folder)
    config = tiny_config("llama", num_hidden_layers=4)
    info = arch_info(config)
    plans = []

    def split(cfg):  # 6 MiB of host memory: the embeddings and layer 0 stay, layers 1-3 go to disk
        plans.append(memory.plan(cfg, info, dtype=torch.float32, device=torch.device("cpu"), batch_size=2,
                                 seq_len=32, heldout_tokens=32, device_map="auto", max_memory={"cpu": 6 * MiB},
                                 offload=True))
        return plans[-1].device_map

    whole = load_model(str(folder), device="cpu", dtype="float32")
    spread = load_model(str(folder), device="cpu", dtype="float32", placement=split,
                        offload_folder=str(tmp_path / "offload"))
    where = set(spread.model.hf_device_map.values())
    assert where == {"cpu", "disk"}, spread.model.hf_device_map
    assert any(p.device.type == "meta" for p in spread.model.parameters())  # really offloaded

    torch.manual_seed(0)
    ids = torch.randint(0, 512, (5, 32))
    seqs = TokenSequences(ids[:4], ids[4:], "random", False)
    noop = lambda *a, **k: None  # noqa: E731
    ref = accumulate(whole, seqs, CalibrationSettings(batch_size=2), AccumulatorStore(tmp_path / "a"), noop)
    got = accumulate(spread, seqs, CalibrationSettings(batch_size=2, accumulate_on="cpu"),
                     AccumulatorStore(tmp_path / "b"), noop)
    for r, g in (*zip(ref[:3], got[:3]), *zip(ref[5], got[5])):  # the three targets, the key and value means
        assert torch.allclose(g.sums, r.sums, rtol=1e-12, atol=1e-12 * r.sums.abs().max())
        assert torch.equal(g.weights, r.weights)
    assert torch.equal(ref[3]["3.k"], got[3]["3.k"])
