"""Cluster files: the bundled examples, the Cluster queries, and every validation error."""
from __future__ import annotations

import argparse
import textwrap

import pytest

from autopar.core.cluster import Cluster, Link, NodeGroup, available_clusters, load_cluster
from autopar.core.cluster_file import add_cluster_arguments, cluster_from_args
from autopar.core.errors import ClusterFileError

# name -> (nodes, GPUs per node, GPU type, intra-node GB/s, inter-node GB/s per GPU); the figures
# are the datasheet ones the files cite (A100: NVLink3 600/2, 200 Gb/s HDR / 8; H100: NVLink4
# 900/2, 400 Gb/s NDR / 8).
EXPECTED = {
    "dgx-a100-1x8": (1, 8, "a100-80gb-sxm", 300, 25),
    "dgx-a100-4x8": (4, 8, "a100-80gb-sxm", 300, 25),
    "dgx-a100-192x8": (192, 8, "a100-80gb-sxm", 300, 25),
    "h100-16x8": (16, 8, "h100-sxm", 450, 50),
    "h100-128x8": (128, 8, "h100-sxm", 450, 50),
    "local-cpu": (1, 4, "local-cpu", None, None),
    # one 100 GbE port per node: 100 / 8 bits / 8 GPUs (a network-bound data-parallel reduce)
    "ethernet-8x8": (8, 8, "a100-80gb-sxm", 300, 1.5625),
}

GOOD = """\
name: test
backend: nccl
inter_node: {bandwidth_GBps: 25, latency_us: 5}
groups:
  - name: a100
    gpu: a100-80gb-sxm
    nodes: 2
    gpus_per_node: 8
    gpu_memory_GB: 80
    intra_node: {bandwidth_GBps: 300, latency_us: 3}
    host_memory_GB: 2048
    host_to_device: {bandwidth_GBps: 32, latency_us: 10}
"""


def write(tmp_path, text, name="c.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_bundled_list_is_complete():
    assert set(available_clusters()) == set(EXPECTED) | {"mixed-a100-h100", "h100-96gb-500w-1x8", "dgx-a100-1x8-nvme",
                                                         "dgx2-1x16-nvme"}


def test_grand_teton_cluster_takes_the_variant_from_its_profile():
    """The torchtitan benchmark's host: 8 GPUs, NVLink4 450 and 400 Gb/s per GPU (torchtitan's hardware
    statement), and the GPU's memory from the profile it names (94 GiB usable of the 96 GB HBM2e)."""
    c = load_cluster("h100-96gb-500w-1x8")
    assert c.world_size == 8 and [g.gpu for g in c.groups] == ["h100-sxm-96gb-500w"] and c.backend == "nccl"
    assert c.groups[0].intra_node.bandwidth_GBps == 450 and c.inter_node.bandwidth_GBps == 400 / 8
    assert c.groups[0].gpu_memory_bytes == 94 * 2**30
    assert load_cluster("h100-96gb-500w-1x8", nodes=16).world_size == 128


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_bundled_cluster_loads_with_its_figures(name):
    nodes, per_node, gpu, intra, inter = EXPECTED[name]
    c = load_cluster(name)
    assert c.name == name and c.num_nodes == nodes and c.world_size == nodes * per_node
    assert [g.gpu for g in c.groups] == [gpu]
    assert len(list(c.devices())) == c.world_size
    if intra is not None:
        assert c.backend == "nccl"
        assert c.groups[0].intra_node.bandwidth_GBps == intra and c.inter_node.bandwidth_GBps == inter
        assert c.groups[0].gpu_memory_bytes == 80 * 10**9
    else:
        assert c.backend == "gloo"


def test_bundled_by_path_and_with_suffix_is_the_same(tmp_path):
    import importlib.resources as r
    path = r.files("autopar.examples.clusters") / "dgx-a100-4x8.yaml"
    assert load_cluster(str(path)).groups == load_cluster("dgx-a100-4x8.yaml").groups == load_cluster("dgx-a100-4x8").groups


def test_link_picks_inter_node_across_nodes_and_intra_inside():
    c = load_cluster("dgx-a100-4x8")
    assert c.link(range(8)) == Link(300, 3)                 # one node: NVSwitch
    assert c.link([6, 7, 8, 9]) == Link(25, 5)               # spans node 0 and node 1
    assert c.link([0, 8, 16, 24]) == c.inter_node


def test_heterogeneous_cluster_ranks_and_links():
    c = load_cluster("mixed-a100-h100")
    assert c.world_size == 32 and not c.homogeneous
    assert [c.group_of(r).gpu for r in (0, 15, 16, 31)] == ["a100-80gb-sxm"] * 2 + ["h100-sxm"] * 2
    assert c.device(16).node == 2 and c.device(31).node == 3
    assert c.link(range(8)).bandwidth_GBps == 300             # an A100 node
    assert c.link(range(16, 24)).bandwidth_GBps == 450        # an H100 node
    assert c.link([0, 16]) == c.inter_node                    # across the two groups


def test_link_in_a_hand_built_group_takes_the_slowest_member():
    # Cluster.link takes the minimum over the groups of the ranks; within one node that is one
    # group, so the result equals that group's link, whatever the other group's figure.
    slow = NodeGroup("slow", "a100-80gb-sxm", 1, 2, 10**9, Link(10, 1), 10**9, Link(1, 1))
    fast = NodeGroup("fast", "h100-sxm", 1, 2, 10**9, Link(100, 1), 10**9, Link(1, 1))
    c = Cluster("x", (slow, fast), Link(5, 2))
    assert c.link([0, 1]).bandwidth_GBps == 10 and c.link([2, 3]).bandwidth_GBps == 100
    assert c.link([1, 2]).bandwidth_GBps == 5


def test_scaled_and_nodes_argument():
    c = load_cluster("dgx-a100-1x8", nodes=16)
    assert c.world_size == 128 and c.num_nodes == 16 and c.name == "dgx-a100-1x8@16nodes"
    assert c.link([0, 8]) == c.inter_node
    with pytest.raises(ClusterFileError, match="node groups"):
        load_cluster("mixed-a100-h100", nodes=8)
    with pytest.raises(ClusterFileError, match="positive"):
        load_cluster("dgx-a100-1x8", nodes=0)


def test_cli_arguments():
    p = argparse.ArgumentParser()
    add_cluster_arguments(p)
    c = cluster_from_args(p.parse_args(["--cluster", "h100-16x8", "--nodes", "2"]))
    assert c.world_size == 16
    with pytest.raises(SystemExit):
        p.parse_args([])


def test_defaults_come_from_the_profile(tmp_path):
    from autopar.profiles import load_profile
    text = GOOD.replace("    gpu_memory_GB: 80\n", "").replace("    intra_node: {bandwidth_GBps: 300, latency_us: 3}\n", "")
    text = text.replace("    host_to_device: {bandwidth_GBps: 32, latency_us: 10}\n", "").replace("name: test\n", "")
    prof = load_profile("a100-80gb-sxm")
    c = load_cluster(write(tmp_path, text, "no-name.yaml"))
    g = c.groups[0]
    assert c.name == "no-name"
    assert g.gpu_memory_bytes == prof["memory_bytes"]
    assert g.intra_node == Link(prof["nvlink_GBps"], prof["nvlink_latency_us"])
    assert g.host_to_device == Link(prof["pcie_GBps"], prof["pcie_latency_us"])


def test_profile_path_relative_to_the_file(tmp_path):
    import shutil
    from autopar.profiles import profile_path
    shutil.copy(profile_path("h200"), tmp_path / "mine.json")
    c = load_cluster(write(tmp_path, GOOD.replace("gpu: a100-80gb-sxm", "gpu: mine.json")))
    assert c.groups[0].gpu == str((tmp_path / "mine.json").resolve())


# (description, text change, words the message must hold)
BAD = [
    ("typo at top level", ("inter_node:", "inter_nodes:"), ["inter_nodes", "'inter_node'", "groups"]),
    ("typo in a group", ("gpus_per_node", "gpu_per_node"), ["groups[0].gpu_per_node", "'gpus_per_node'", "host_memory_GB"]),
    ("typo in a link", ("{bandwidth_GBps: 300", "{bandwith_GBps: 300"), ["groups[0].intra_node.bandwith_GBps", "'bandwidth_GBps'", "latency_us"]),
    ("missing key", ("    host_memory_GB: 2048\n", ""), ["groups[0]", "'host_memory_GB'", "missing"]),
    ("missing link key", ("{bandwidth_GBps: 25, latency_us: 5}", "{bandwidth_GBps: 25}"), ["inter_node", "'latency_us'"]),
    ("zero gpus", ("gpus_per_node: 8", "gpus_per_node: 0"), ["groups[0].gpus_per_node", "line 8", "0", ">= 1"]),
    ("negative nodes", ("nodes: 2", "nodes: -1"), ["groups[0].nodes", "-1", ">= 1"]),
    ("fractional nodes", ("nodes: 2", "nodes: 1.5"), ["groups[0].nodes", "1.5", "whole"]),
    ("zero bandwidth", ("bandwidth_GBps: 300", "bandwidth_GBps: 0"), ["groups[0].intra_node.bandwidth_GBps", "> 0"]),
    ("negative bandwidth", ("bandwidth_GBps: 25", "bandwidth_GBps: -25"), ["inter_node.bandwidth_GBps", "-25", "> 0"]),
    ("negative latency", ("latency_us: 10", "latency_us: -1"), ["groups[0].host_to_device.latency_us", ">= 0"]),
    ("text for a number", ("gpu_memory_GB: 80", "gpu_memory_GB: lots"), ["groups[0].gpu_memory_GB", "'lots'", "number"]),
    ("yaml 1e9", ("host_memory_GB: 2048", "host_memory_GB: 2e3"), ["groups[0].host_memory_GB", "1.0e+9"]),
    ("bool for a number", ("nodes: 2", "nodes: true"), ["groups[0].nodes", "True"]),
    ("unknown gpu", ("gpu: a100-80gb-sxm", "gpu: a100-80gb"), ["groups[0].gpu", "'a100-80gb'", "a100-80gb-sxm", "h100-sxm", "h200", "local-cpu"]),
    ("missing profile file", ("gpu: a100-80gb-sxm", "gpu: nowhere.json"), ["groups[0].gpu", "nowhere.json", "h100-sxm"]),
    ("bad backend", ("backend: nccl", "backend: mpi"), ["backend", "'mpi'", "nccl, gloo"]),
    ("nccl on cpu", ("gpu: a100-80gb-sxm", "gpu: local-cpu"), ["backend", "gloo"]),
    ("group not a mapping", ("  - name: a100\n", "  - a100\n  - name: a100\n"), ["groups[0]", "'a100'", "mapping"]),
    ("duplicate key", ("    nodes: 2\n", "    nodes: 2\n    nodes: 3\n"), ["line 8", "twice"]),
    ("syntax error", ("inter_node: {bandwidth_GBps: 25, latency_us: 5}", "inter_node: {bandwidth_GBps: 25, latency_us: 5"), ["not valid YAML", "line"]),
    ("empty group name", ("- name: a100", "- name: ''"), ["groups[0].name", "non-empty"]),
]


@pytest.mark.parametrize("what,change,words", BAD, ids=[b[0] for b in BAD])
def test_bad_file_names_the_field(tmp_path, what, change, words):
    old, new = change
    assert old in GOOD
    path = write(tmp_path, GOOD.replace(old, new, 1))
    with pytest.raises(ClusterFileError) as info:
        load_cluster(path)
    message = str(info.value)
    assert path in message and "\n" not in message
    for word in words:
        assert word in message, (word, message)


def test_duplicate_group_names(tmp_path):
    group = GOOD[GOOD.index("  - name: a100"):]
    with pytest.raises(ClusterFileError, match=r"groups\[1\]\.name.*'a100'"):
        load_cluster(write(tmp_path, GOOD + group))


def test_groups_must_be_a_non_empty_list(tmp_path):
    head = GOOD[:GOOD.index("groups:")]
    for value in ("3", "[]"):
        with pytest.raises(ClusterFileError, match=r"field groups \(line 4\).*non-empty list"):
            load_cluster(write(tmp_path, head + f"groups: {value}\n"))


def test_empty_file_and_top_level_list(tmp_path):
    with pytest.raises(ClusterFileError, match="empty"):
        load_cluster(write(tmp_path, ""))
    with pytest.raises(ClusterFileError, match="mapping"):
        load_cluster(write(tmp_path, "- 1\n- 2\n"))


def test_missing_file_lists_the_bundled_clusters(tmp_path):
    with pytest.raises(ClusterFileError) as info:
        load_cluster(str(tmp_path / "nope.yaml"))
    for name in available_clusters():
        assert name in str(info.value)
    with pytest.raises(ClusterFileError, match="dgx-a100-4x8"):
        load_cluster("dgx-a100-3x8")
