"""Profiles: every bundled file loads, carries the datasheet peaks, cites every figure, and a
malformed profile is rejected with the offending key named."""
from __future__ import annotations

import json

import pytest

from autopar.profiles import (DTYPES, EFFICIENCY_KINDS, ProfileError, available_profiles, load_profile,
                              profile_path)

# Datasheet figures, dense (no structured sparsity): FLOP/s per dtype, HBM bytes/s.
# A100 80GB SXM: NVIDIA A100 datasheet.  H100 SXM: H100 datasheet / whitepaper (FP32 66.9, rounded
# to 67 on the datasheet).  H200: H200 datasheet (H100 compute, 4.8 TB/s, 141 GB).
DATASHEET = {
    "a100-80gb-sxm": ({"fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "fp16": 312e12}, 2.039e12),
    "h100-sxm": ({"fp32": 66.9e12, "tf32": 494.7e12, "bf16": 989.4e12, "fp16": 989.4e12}, 3.35e12),
    "h200": ({"fp32": 66.9e12, "tf32": 494.7e12, "bf16": 989.4e12, "fp16": 989.4e12}, 4.8e12),
    # Tesla V100 SXM2: 15.7 TFLOPS fp32, 125 tensor (fp16); no tf32 or bf16 units (the fp32 rate)
    "a100-pcie-40gb": ({"fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "fp16": 312e12}, 1.555e12),
    "v100-32gb-sxm": ({"fp32": 15.7e12, "tf32": 15.7e12, "bf16": 15.7e12, "fp16": 125e12}, 0.9e12),
}
LINKS_GBps = {  # per direction: NVLink3 600/2, NVLink4 900/2; PCIe Gen4 64/2, Gen5 128/2; NIC / 8 bits
    "a100-80gb-sxm": (300, 32, 25), "h100-sxm": (450, 64, 50), "h200": (450, 64, 50),
    "a100-pcie-40gb": (300, 32, 1.25),  # NVLink bridge 600/2, PCIe Gen4 64/2, 10 GbE (an assumption)
    "v100-32gb-sxm": (150, 16, 6.25)}   # NVLink2 300/2, PCIe Gen3 32/2, DGX-2: 8 x 100 Gb/s / 8 / 16 GPUs
LINK_KEYS = ("nvlink_GBps", "nvlink_latency_us", "pcie_GBps", "pcie_latency_us", "network_GBps_per_gpu")


def test_bundled_names():
    assert available_profiles() == ["a100-80gb-sxm", "a100-pcie-40gb", "h100-sxm", "h100-sxm-96gb-500w", "h200", "local-cpu",
                                    "v100-32gb-sxm"]


@pytest.mark.parametrize("name", ["a100-80gb-sxm", "a100-pcie-40gb", "h100-sxm", "h100-sxm-96gb-500w", "h200", "local-cpu",
                                  "v100-32gb-sxm"])
def test_profile_loads_and_cites_every_figure(name):
    prof = load_profile(name)
    assert prof["name"] == name and profile_path(name).name == f"{name}.json"
    assert load_profile(str(profile_path(name))) == prof
    assert prof["device"] == ("cpu" if name == "local-cpu" else "gpu")
    cited = [f"peak_flops.{d}" for d in DTYPES] + [f"efficiency.{k}" for k in EFFICIENCY_KINDS]
    cited += ["collective_efficiency.intra", "collective_efficiency.inter", "memory_bytes", "memory_bandwidth_Bps",
              *LINK_KEYS]
    missing = [k for k in cited if not prof["sources"].get(k, "").strip()]
    assert not missing, f"{name}: no source for {missing}"
    for key in LINK_KEYS:
        assert key in prof


@pytest.mark.parametrize("name", sorted(DATASHEET))
def test_peaks_match_the_datasheet(name):
    prof = load_profile(name)
    flops, bandwidth = DATASHEET[name]
    for dtype, value in flops.items():
        assert prof["peak_flops"][dtype] == pytest.approx(value, rel=0.005), dtype
    assert prof["memory_bandwidth_Bps"] == pytest.approx(bandwidth, rel=1e-3)
    nvlink, pcie, network = LINKS_GBps[name]
    assert (prof["nvlink_GBps"], prof["pcie_GBps"], prof["network_GBps_per_gpu"]) == (nvlink, pcie, network)


def test_memory_sizes():
    assert load_profile("a100-80gb-sxm")["memory_bytes"] == pytest.approx(80e9, rel=0.08)   # 80 GB (80 GiB)
    assert load_profile("h100-sxm")["memory_bytes"] == pytest.approx(80e9, rel=0.08)
    assert load_profile("h200")["memory_bytes"] == pytest.approx(141e9, rel=0.01)
    assert load_profile("v100-32gb-sxm")["memory_bytes"] == 32 * 2**30                    # 32 GB HBM2
    assert load_profile("a100-pcie-40gb")["memory_bytes"] == 40 * 2**30                   # 40 GB HBM2


def test_local_cpu_peak_is_a_plausible_measurement():
    # 1 thread of a Zen 3 core: 2 FMA pipes x 8 fp32 lanes x 2 FLOP = 32 FLOP/cycle at 2-3.7 GHz
    # (AMD Zen 3 microarchitecture), i.e. 64-118 GFLOP/s; the measured figure must sit below the
    # top of that range and not far under its bottom.
    fp32 = load_profile("local-cpu")["peak_flops"]["fp32"]
    assert 40e9 < fp32 < 32 * 3.7e9


@pytest.fixture
def good():
    return json.loads(profile_path("h100-sxm").read_text())


def _reject(tmp_path, prof, *words):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(prof))
    with pytest.raises(ProfileError) as info:
        load_profile(str(path))
    message = str(info.value)
    assert str(path) in message
    for w in words:
        assert w in message, (w, message)
    with pytest.raises(ProfileError):       # the same check on a dict (what `autopar profile` calls)
        load_profile(prof)


def test_bad_profiles_name_the_key(tmp_path, good):
    _reject(tmp_path, {**good, "peak_flop": good["peak_flops"]}, "peak_flop", "'peak_flops'")
    _reject(tmp_path, {k: v for k, v in good.items() if k != "memory_bytes"}, "memory_bytes", "missing")
    _reject(tmp_path, {**good, "memory_bandwidth_Bps": -1}, "memory_bandwidth_Bps", "-1", "> 0")
    _reject(tmp_path, {**good, "memory_bytes": "80GB"}, "memory_bytes", "'80GB'")
    _reject(tmp_path, {**good, "device": "tpu"}, "device", "gpu, cpu")
    _reject(tmp_path, {**good, "peak_flops": {**good["peak_flops"], "bf16": 0}}, "peak_flops.bf16", "> 0")
    _reject(tmp_path, {**good, "peak_flops": {k: v for k, v in good["peak_flops"].items() if k != "tf32"}},
            "peak_flops.tf32", "missing")
    _reject(tmp_path, {**good, "efficiency": {**good["efficiency"], "linear": 1.5}}, "efficiency.linear", "(0, 1]")
    _reject(tmp_path, {**good, "efficiency": {**good["efficiency"], "lineer": 0.5}}, "efficiency.lineer", "'linear'")
    _reject(tmp_path, {**good, "nvlink_GBps": 0}, "nvlink_GBps", "> 0")
    _reject(tmp_path, {**good, "gemm_tile": [256]}, "gemm_tile")
    _reject(tmp_path, {**good, "op_table": [{"kind": "linear", "dtype": "bf16", "flops": 1e9, "bytes": 1e6,
                                             "seconds": 0, "shape": [8, 8]}]}, "op_table[0].seconds", "> 0")
    _reject(tmp_path, {**good, "collective_table": [{"op": "all_reduce", "bytes": 1024, "group_size": 8,
                                                     "level": "rack", "seconds": 1e-5}]},
            "collective_table[0].level", "intra, inter")
    _reject(tmp_path, {**good, "sync_wait": {"processes": 2}}, "sync_wait", "a list of rows")
    _reject(tmp_path, {**good, "sync_wait": [{"processes": 0, "per_compute": 0.1}]}, "sync_wait[0].processes")
    _reject(tmp_path, {**good, "sync_wait": [{"processes": 2}]}, "sync_wait[0].per_compute", "missing")
    _reject(tmp_path, {**good, "collective_table": [{"op": "all_reduce", "bytes": 1024, "level": "intra",
                                                     "seconds": 1e-5}]}, "collective_table[0].group_size", "missing")


def test_measured_rows_with_extra_keys_are_accepted(good):
    row = {"kind": "linear", "variant": "nn", "dtype": "bf16", "flops": 2e9, "bytes": 3e6, "seconds": 1e-5,
           "shape": [1024, 1024, 1024], "num_samples": 5}
    coll = {"op": "all_reduce", "bytes": 2**20, "group_size": 8, "level": "intra", "seconds": 2e-5, "backend": "nccl"}
    prof = load_profile({**good, "op_table": [row], "collective_table": [coll], "measured_by": "autopar profile"})
    assert prof["op_table"][0]["seconds"] == 1e-5


def test_unknown_name_and_missing_file_list_the_profiles(tmp_path):
    with pytest.raises(ProfileError, match="a100-80gb-sxm, a100-pcie-40gb, h100-sxm, h100-sxm-96gb-500w, h200, local-cpu, v100-32gb-sxm"):
        load_profile("b200")
    with pytest.raises(ProfileError, match="does not exist"):
        load_profile(str(tmp_path / "none.json"))
    (tmp_path / "broken.json").write_text('{"name": "x",\n "device": }')
    with pytest.raises(ProfileError, match="line 2"):
        load_profile(str(tmp_path / "broken.json"))


def test_gpu_variant_derives_its_rates_from_its_clock_and_cites_it():
    """H100 SXM 96 GB HBM2e at 500 W (torchtitan's hardware statement): the SXM5 datasheet peaks on
    the same die, scaled by sustained / boost clock (core/clocks.py): 1545 / 1830 of 989.4 is the
    H100 NVL datasheet's dense bf16 figure, 1,671 / 2 TFLOP/s; 2.4 TB/s; 500 W; each figure cited."""
    from autopar.core.clocks import clock_ratio
    from autopar.simulator.device.cost_model import CostModel

    prof = load_profile("h100-sxm-96gb-500w")
    flops, _ = DATASHEET["h100-sxm"]
    for dtype, value in flops.items():
        assert prof["peak_flops"][dtype] == pytest.approx(value, rel=0.005), dtype
    assert prof["memory_bandwidth_Bps"] == 2.4e12 and prof["power_limit_W"] == 500
    assert prof["memory_bytes"] == 94 * 2**30
    for key in ("power_limit_W", "boost_clock_MHz", "sustained_clock_MHz"):
        assert prof["sources"][key].strip()
    # 989.4 TFLOP/s = 132 SMs x 4096 FLOPs per SM per clock x the boost clock (H100 whitepaper)
    assert prof["boost_clock_MHz"] * 1e6 * 132 * 4096 == pytest.approx(989.4e12, rel=1e-3)
    cm = CostModel.from_profile("h100-sxm-96gb-500w")
    assert cm.peak("bf16") == pytest.approx(1671e12 / 2, rel=0.002)
    assert cm.peak("fp32") == pytest.approx(prof["peak_flops"]["fp32"] * clock_ratio(prof))
    # a flash-attention kernel's published rate (measured on the SXM5) runs at the same clock ratio
    from types import SimpleNamespace

    op = SimpleNamespace(causal=True, input_shapes=((2, 32, 8192, 128),))
    slow = cm.fused_attention_s(op, 1e12, "bf16", backward=False)
    fast = CostModel.from_profile("h100-sxm").fused_attention_s(op, 1e12, "bf16", backward=False)
    assert slow / fast == pytest.approx(prof["boost_clock_MHz"] / prof["sustained_clock_MHz"])
    # a profile without the clocks keeps its datasheet peaks
    assert CostModel.from_profile("h100-sxm").peak("bf16") == load_profile("h100-sxm")["peak_flops"]["bf16"]
    for bad in ({"sustained_clock_MHz": 0}, {"power_limit_W": "500 W"}):
        with pytest.raises(ProfileError, match=next(iter(bad))):
            load_profile({**prof, **bad})
