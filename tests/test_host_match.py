"""core/host_match.py: a CPU profile measured on another processor is named as such."""
from autopar.core.host_match import advice, mismatch, this_host

HOST = {"cpu_model": "Intel(R) Xeon(R) Processor", "num_cpu_cores": 2, "cpu_capability": "AVX512"}


def _profile(**machine):
    return {"device": "cpu", "machine": machine}


def test_same_machine_says_nothing():
    assert mismatch(_profile(**HOST, torch_version="x"), HOST) == []


def test_other_processor_is_named_with_both_sides():
    diff = mismatch(_profile(cpu_model="AMD EPYC", num_cpu_cores=2, cpu_capability="AVX2"), HOST)
    assert diff == ["cpu_model: AMD EPYC -> Intel(R) Xeon(R) Processor", "cpu_capability: AVX2 -> AVX512"]
    text = advice("local-cpu", diff)
    assert "AMD EPYC" in text and "--skip-collectives --skip-overheads --skip-sync-wait" in text


def test_gpu_profiles_and_unrecorded_machines_are_left_alone():
    assert mismatch({"device": "gpu", "machine": {"cpu_model": "x"}}, HOST) == []
    assert mismatch({"device": "cpu"}, HOST) == []
    assert mismatch(_profile(cpu_model=None), HOST) == []


def test_this_host_reads_the_processor():
    h = this_host()
    assert set(h) == {"cpu_model", "num_cpu_cores", "cpu_capability"} and h["num_cpu_cores"] >= 1
