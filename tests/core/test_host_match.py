"""core/host_match.py: a CPU profile measured on another processor is named as such."""
from autopar.core.host_match import advice, mismatch, op_processes, this_host

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
    assert "--nproc-per-node 2 " in text


def test_the_advice_times_with_as_many_processes_as_the_rows_were():
    from autopar.profiles import load_profile

    assert op_processes({"op_table": [{"ranks": 2}, {"ranks": 2}, {}]}) == 2
    assert op_processes({"op_table": [{}]}) == 1
    # the bundled profile's rows were timed on two processes at once (its measured_by)
    prof = load_profile("local-cpu")
    assert op_processes(prof) == 2 and "--nproc-per-node 2" in prof["measured_by"]


def test_gpu_profiles_and_unrecorded_machines_are_left_alone():
    assert mismatch({"device": "gpu", "machine": {"cpu_model": "x"}}, HOST) == []
    assert mismatch({"device": "cpu"}, HOST) == []
    assert mismatch(_profile(cpu_model=None), HOST) == []


def test_this_host_reads_the_processor():
    h = this_host()
    assert set(h) == {"cpu_model", "num_cpu_cores", "cpu_capability"} and h["num_cpu_cores"] >= 1
