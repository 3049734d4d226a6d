"""Reading and validating cluster files (cluster.yaml) into a ``Cluster``.

Schema (docs/cluster-file.md has the long version)::

    name: dgx-a100-1x8            # optional; default: the file name without .yaml
    backend: nccl                 # optional; nccl | gloo; default gloo for CPU profiles, else nccl
    inter_node: {bandwidth_GBps: 25, latency_us: 5}   # per GPU share of the node's network
    groups:                       # one or more node groups; ranks are numbered group by group
      - name: a100
        gpu: a100-80gb-sxm        # a bundled profile name, or a path to a profile .json
                                  # (relative to this file)
        nodes: 1
        gpus_per_node: 8
        gpu_memory_GB: 80         # optional; default: the profile's memory_bytes
        intra_node: {bandwidth_GBps: 300, latency_us: 3}   # optional; default: profile nvlink_*
        host_memory_GB: 2048      # per node
        host_to_device: {bandwidth_GBps: 32, latency_us: 10} # optional; default: profile pcie_*
        env: {NCCL_SOCKET_IFNAME: ib0}   # optional; exported on this group's nodes (wins over the top level's)
        nvme: {path: /local/nvme, capacity_GB: 3840, read_GBps: 12, write_GBps: 8}
                                  # optional; per node, all its drives (autopar profile --disk PATH)
    env: {NCCL_IB_HCA: mlx5}      # optional; exported on every node by the launch scripts

``GB`` and ``GBps`` are decimal (10^9 bytes, 10^9 bytes/s); bandwidths are per GPU and per
direction.  Every problem raises ``ClusterFileError`` naming the file, the field path (e.g.
``groups[0].intra_node.bandwidth_GBps``), its line, the value and what is allowed.

Bounds (``LIMITS``; docs/cluster-file.md): the file is at most 1 MiB and uses no YAML aliases
(``*name``: a few lines of nested aliases expand to billions of nodes); a cluster has at most
``MAX_DEVICES`` devices, and every figure has an upper bound far above any machine built, so
that a typo like ``1e300`` is refused instead of overflowing later.
"""
from __future__ import annotations

import difflib
import re
from importlib import resources
from pathlib import Path
from typing import NoReturn

import yaml

from autopar.core import schema
from autopar.core.cluster_types import BACKENDS, MAX_DEVICES, Cluster, Link, NodeGroup, Nvme
from autopar.core.errors import ClusterFileError
from autopar.core.jsonfile import read_text_bounded
from autopar.core.profile_schema import ProfileError, available_profiles, load_profile

_PACKAGE = "autopar.examples.clusters"

TOP_REQUIRED = ("inter_node", "groups")
TOP_OPTIONAL = ("name", "backend", "env")
GROUP_REQUIRED = ("name", "gpu", "nodes", "gpus_per_node", "host_memory_GB")
GROUP_OPTIONAL = ("gpu_memory_GB", "intra_node", "host_to_device", "compute_slots", "env", "nvme")
NVME_REQUIRED = ("path", "capacity_GB", "read_GBps", "write_GBps")
LINK_REQUIRED = ("bandwidth_GBps", "latency_us")

_DOCS = "See docs/cluster-file.md for the schema."

#: largest cluster file read, bytes (the bundled ones are ~2 KB)
MAX_CLUSTER_FILE_BYTES = 2**20
#: upper bound of each figure: far above any machine built (the largest GPU memory sold is
#: 0.3 TB, the largest link 0.9 TB/s per direction), low enough that bytes and seconds computed
#: from them stay finite and exact in an int.
LIMITS = {"gpu_memory_GB": 1e5, "host_memory_GB": 1e6, "bandwidth_GBps": 1e6, "latency_us": 1e9,
          "capacity_GB": 1e8}


def available_clusters() -> list[str]:
    """Names of the bundled cluster files in autopar/examples/clusters (without .yaml), sorted."""
    return sorted(p.name[:-len(".yaml")] for p in resources.files(_PACKAGE).iterdir() if p.name.endswith(".yaml"))


def load_cluster(path_or_name: str, *, nodes: int | None = None) -> Cluster:
    """Read a cluster file (a path, or the name of a bundled cluster) and validate it.

    ``nodes`` rescales a single-group cluster to that many nodes (``Cluster.scaled``).
    An existing file wins over a bundled name.
    """
    text, source, base_dir, stem = _read(str(path_or_name))
    cluster = parse_cluster(text, source=source, base_dir=base_dir, default_name=stem)
    return cluster if nodes is None else cluster.scaled(nodes)


def add_cluster_arguments(parser, *, required: bool = True) -> None:
    """``--cluster PATH_OR_NAME`` and ``--nodes N`` on an argparse parser (see cluster_from_args)."""
    names = ", ".join(available_clusters())
    parser.add_argument("--cluster", metavar="PATH_OR_NAME", required=required,
                        default=None if required else "local-cpu",
                        help=f"cluster file (YAML, docs/cluster-file.md) or a bundled cluster: {names}"
                             + ("" if required else " (default: local-cpu)"))
    parser.add_argument("--nodes", metavar="N", type=int, default=None,
                        help="scale a single-group cluster to N nodes (what-if; the file stays as it is)")


def cluster_from_args(args) -> Cluster:
    """The cluster named by the arguments ``add_cluster_arguments`` added."""
    return load_cluster(args.cluster, nodes=args.nodes)


# ----------------------------------------------------------------------------- reading

def _read(path_or_name: str) -> tuple[str, str, Path | None, str]:
    path = Path(path_or_name).expanduser()
    bundled = path_or_name[:-len(".yaml")] if path_or_name.endswith(".yaml") else path_or_name
    if path.is_file():
        file, source, base_dir = path, str(path), path.parent
    elif "/" not in path_or_name and bundled in available_clusters():
        file = resources.files(_PACKAGE) / f"{bundled}.yaml"
        source, base_dir = f"{bundled} (bundled: {file})", None
    else:
        what = "is a directory, not a file" if path.is_dir() else "is neither a file nor a bundled cluster name"
        raise ClusterFileError(
            f"cluster {path_or_name!r} {what}. Bundled clusters: {', '.join(available_clusters())}. "
            f"Pass one of these names or the path of a YAML cluster file. {_DOCS}")
    text = read_text_bounded(Path(str(file)), what="cluster file", error=ClusterFileError,
                             limit=MAX_CLUSTER_FILE_BYTES)
    from autopar.core.output_file import note_input

    note_input(Path(str(file)), "cluster file")
    return text, source, base_dir, Path(file.name).stem


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (PyYAML keeps the last silently)
    and any alias (``*name``): nested aliases expand exponentially (the "billion laughs" file),
    and a cluster file is short enough to write out."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(
                None, None, f"the alias *{event.anchor} is not allowed (a cluster file uses no anchors or "
                            f"aliases; write the values out)", event.start_mark)
        return super().compose_node(parent, index)


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: set = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(None, None, f"the key {key!r} appears twice in one mapping",
                                                    key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node, deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _lines(node: yaml.Node | None, prefix: str, out: dict[str, int]) -> dict[str, int]:
    """Field path -> 1-based line number, for every mapping key and list item below ``node``."""
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            path = f"{prefix}.{key_node.value}" if prefix else str(key_node.value)
            out[path] = key_node.start_mark.line + 1
            _lines(value_node, path, out)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            path = f"{prefix}[{i}]"
            out[path] = item.start_mark.line + 1
            _lines(item, path, out)
    return out


def parse_cluster(text: str, *, source: str = "<text>", base_dir: Path | None = None,
                  default_name: str = "cluster") -> Cluster:
    """A validated Cluster from the YAML ``text`` of a cluster file (``source`` names it in errors)."""
    loader = _StrictLoader(text)
    try:
        node = loader.get_single_node()
        data = loader.construct_document(node) if node is not None else None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e)
        hint = ("" if isinstance(e, yaml.composer.ComposerError) else
                " Fix the syntax (indentation, a missing ':' or an unclosed bracket are the usual causes).")
        raise ClusterFileError(f"cluster file {source} is not valid YAML{where}: {problem}.{hint} {_DOCS}") from None
    finally:
        loader.dispose()
    return _Validator(source, _lines(node, "", {}), base_dir).cluster(data, default_name)


# -------------------------------------------------------------------------- validation

def _limited(name: str, *, positive: bool) -> schema.Leaf:
    """A figure of the file: a number > 0 (or >= 0) up to ``LIMITS[name]``; text is refused with
    a hint, since YAML 1.1 reads ``1e9`` (no dot, no sign) as a string."""
    def explain(value: object) -> str | None:
        if not isinstance(value, str):
            return None
        return "a number, not text" + (" (YAML 1.1 reads 1e9 as text: write 1.0e+9)" if "e" in value.lower() else "")
    return schema.number_leaf(positive=positive, upper=LIMITS[name], explain=explain)


def _mapping(required: tuple[str, ...], optional: dict, fields: dict, then=None) -> schema.Mapping:
    allowed = required + tuple(optional)
    return schema.Mapping({k: fields[k] for k in required}, "a mapping with the keys " + ", ".join(allowed),
                          optional=optional, then=then)


def _slots_within_node(group: dict, path: str, report: schema.Reporter) -> None:
    """``compute_slots`` (when given) is at most ``gpus_per_node``."""
    slots, per_node = group.get("compute_slots"), group["gpus_per_node"]
    if slots is not None and slots > per_node:
        report.bad_value(f"{path}.compute_slots", slots,
                         f"a whole number from 1 to gpus_per_node ({per_node}): how many devices of a node can "
                         f"compute at once (CPU: physical cores / threads per process)")


#: a POSIX shell variable name (the portable spelling, POSIX.1-2017 XBD 8.1: letters, digits and
#: underscores, not starting with a digit); the launch scripts write ``export NAME=value``
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _env_value_ok(v: object) -> bool:
    if isinstance(v, str):
        return "\0" not in v and "\n" not in v and "\r" not in v
    return schema.is_number(v)


def _env_names(env: dict, path: str, report: schema.Reporter) -> None:
    for key in env:
        if not isinstance(key, str) or not _ENV_NAME.fullmatch(key):
            report.bad_value(schema.join_path(path, key), key, "an environment variable name: letters, digits and "
                                                          "underscores, not starting with a digit")


_ENV = schema.Mapping({}, "a mapping of environment variable names to values (e.g. {NCCL_SOCKET_IFNAME: ib0})",
                      extra=schema.Leaf(_env_value_ok, "a text on one line or a number (quote a yes/no/on/off "
                                                       "value: YAML reads it as a boolean)"),
                      then=_env_names)


def _env_pairs(env: dict | None) -> tuple[tuple[str, str], ...]:
    """A checked ``env`` mapping as (name, text) pairs, in the file's order."""
    return tuple((k, v if isinstance(v, str) else str(v)) for k, v in (env or {}).items())


_WHOLE = schema.whole(lower=1, upper=MAX_DEVICES, must=f"a whole number >= 1 and at most {MAX_DEVICES} (autopar plans "
                                                      f"clusters of at most {MAX_DEVICES} devices)")
_LINK = _mapping(LINK_REQUIRED, {}, {"bandwidth_GBps": _limited("bandwidth_GBps", positive=True),
                                     "latency_us": _limited("latency_us", positive=False)})
_NVME = _mapping(NVME_REQUIRED, {}, {"path": schema.text(), "capacity_GB": _limited("capacity_GB", positive=True),
                                     "read_GBps": _limited("bandwidth_GBps", positive=True),
                                     "write_GBps": _limited("bandwidth_GBps", positive=True)})
_GROUP = _mapping(GROUP_REQUIRED,
                  {"gpu_memory_GB": _limited("gpu_memory_GB", positive=True), "intra_node": _LINK,
                   "host_to_device": _LINK, "compute_slots": _WHOLE, "env": _ENV, "nvme": _NVME},
                  {"name": schema.text(), "gpu": schema.text(), "nodes": _WHOLE, "gpus_per_node": _WHOLE,
                   "host_memory_GB": _limited("host_memory_GB", positive=True)},
                  then=_slots_within_node)
#: the shape of a cluster file; what relates fields across groups, or needs the profile, is
#: checked while the Cluster is built (``_Validator.cluster``)
CLUSTER_SCHEMA = _mapping(TOP_REQUIRED, {"name": schema.text(), "backend": schema.one_of(BACKENDS), "env": _ENV},
                          {"inter_node": _LINK,
                           "groups": schema.ListOf(_GROUP, "a non-empty list of node groups", nonempty=True)})


class _Validator:
    """Checks a parsed cluster file against ``CLUSTER_SCHEMA``, then builds the Cluster; every
    problem is raised as a ``ClusterFileError`` naming the field and its line (``schema.Reporter``)."""

    def __init__(self, source: str, lines: dict[str, int], base_dir: Path | None):
        self.source, self.lines, self.base_dir = source, lines, base_dir

    def fail(self, path: str, message: str) -> NoReturn:
        line = self.lines.get(path)
        at = f" (line {line})" if line else ""
        raise ClusterFileError(f"cluster file {self.source}, field {path or '(top level)'}{at}: {message} {_DOCS}")

    def bad_value(self, path: str, value: object, must: str) -> NoReturn:
        self.fail(path, f"the value is {value!r}; it must be {must}.")

    def unknown_key(self, path: str, key: object, hint: str, allowed: tuple[str, ...]) -> NoReturn:
        self.fail(schema.join_path(path, key), f"unknown key {key!r}.{hint} Allowed keys here: {', '.join(allowed)}.")

    def missing_keys(self, path: str, missing: list[str], required: tuple[str, ...]) -> NoReturn:
        self.fail(path, f"the required key {missing[0]!r} is missing"
                  + (f" (also missing: {', '.join(missing[1:])})" if missing[1:] else "")
                  + f". Required keys here: {', '.join(required)}.")

    def profile(self, name: str, path: str) -> tuple[str, dict]:
        if name.endswith(".json"):
            file = Path(name).expanduser()
            if not file.is_absolute() and self.base_dir is not None:
                file = self.base_dir / file
            if not file.is_file():
                self.bad_value(path, name, f"an existing profile file (looked for {file}) or one of the bundled "
                                           f"profiles: {', '.join(available_profiles())}")
            name = str(file.resolve())
        elif name not in available_profiles():
            close = difflib.get_close_matches(name, available_profiles(), n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            self.fail(path, f"unknown GPU type {name!r}.{hint} Known profiles: {', '.join(available_profiles())}; "
                            f"or give the path of a profile .json written by `autopar profile`.")
        try:
            return name, load_profile(name)
        except ProfileError as e:
            self.fail(path, f"the profile {name!r} is invalid: {e}")

    def link_or_default(self, group: dict, key: str, path: str, profile: dict, gpu: str,
                        bandwidth_key: str, latency_key: str) -> Link:
        if key in group:
            return _link(group[key])
        if bandwidth_key not in profile or latency_key not in profile:
            self.fail(path, f"{key} is not given and profile {gpu!r} has no {bandwidth_key}/{latency_key} to "
                            f"default to; add '{key}: {{bandwidth_GBps: ..., latency_us: ...}}' to the group.")
        return Link(float(profile[bandwidth_key]), float(profile[latency_key]))

    def group(self, g: dict, path: str) -> tuple[NodeGroup, dict]:
        gpu, prof = self.profile(g["gpu"], f"{path}.gpu")
        if "gpu_memory_GB" in g:
            memory_bytes = round(float(g["gpu_memory_GB"]) * 1e9)
        else:
            memory_bytes = int(prof["memory_bytes"])
        group = NodeGroup(
            name=g["name"],
            gpu=gpu,
            nodes=g["nodes"],
            gpus_per_node=g["gpus_per_node"],
            gpu_memory_bytes=memory_bytes,
            intra_node=self.link_or_default(g, "intra_node", path, prof, gpu, "nvlink_GBps", "nvlink_latency_us"),
            host_memory_bytes=round(float(g["host_memory_GB"]) * 1e9),
            host_to_device=self.link_or_default(g, "host_to_device", path, prof, gpu, "pcie_GBps", "pcie_latency_us"),
            compute_slots=g.get("compute_slots", 0),     # 0 (absent) = every device of the node
            env=_env_pairs(g.get("env")),
            nvme=_nvme(g["nvme"]) if "nvme" in g else None,
        )
        return group, prof

    def cluster(self, data: object, default_name: str) -> Cluster:
        if data is None:
            self.fail("", "the file is empty; a cluster file needs at least inter_node and groups.")
        schema.check(CLUSTER_SCHEMA, data, self)
        name = data.get("name", default_name)
        groups, profiles = [], []
        for i, value in enumerate(data["groups"]):
            group, prof = self.group(value, f"groups[{i}]")
            if any(g.name == group.name for g in groups):
                self.bad_value(f"groups[{i}].name", group.name, "a name no other group uses")
            groups.append(group)
            profiles.append(prof)
        devices = sum(g.num_devices for g in groups)
        if devices > MAX_DEVICES:
            self.bad_value("groups", f"{devices} devices", f"at most {MAX_DEVICES} devices in all (nodes x "
                                                          f"gpus_per_node summed over the groups)")
        on_cpu = [g.name for g, p in zip(groups, profiles) if p["device"] == "cpu"]
        backend = data.get("backend", "gloo" if len(on_cpu) == len(groups) else "nccl")
        if backend == "nccl" and on_cpu:
            self.fail("backend", f"nccl needs CUDA GPUs, but group {on_cpu[0]!r} uses a CPU profile; "
                                 f"use 'backend: gloo'.")
        if on_cpu and len(on_cpu) < len(groups):
            gpu = next(g.name for g, p in zip(groups, profiles) if p["device"] != "cpu")
            self.fail("groups", f"group {on_cpu[0]!r} uses a CPU profile and group {gpu!r} a GPU profile; the "
                                f"runtime trains every rank on one kind of device (CPU ranks on gloo, GPU ranks on "
                                f"nccl), so one cluster cannot mix them. Split it into two cluster files.")
        return Cluster(name=name, groups=tuple(groups), inter_node=_link(data["inter_node"]), backend=backend,
                       source=self.source, env=_env_pairs(data.get("env")))


def _nvme(d: dict) -> Nvme:
    """An Nvme from an nvme mapping the schema has checked."""
    return Nvme(path=str(d["path"]), capacity_bytes=round(float(d["capacity_GB"]) * 1e9),
                read_GBps=float(d["read_GBps"]), write_GBps=float(d["write_GBps"]))


def _link(d: dict) -> Link:
    """A Link from a link mapping the schema has checked."""
    return Link(bandwidth_GBps=float(d["bandwidth_GBps"]), latency_us=float(d["latency_us"]))
