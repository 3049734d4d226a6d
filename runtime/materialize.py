"""Build the model on the meta device and give each rank the values of its own shards.

The model is built under ``torch.device("meta")`` (no memory), parallelised there (TP, FSDP
wrap the meta parameters), then ``to_empty`` allocates only this rank's shards and
``fill_from_source`` copies in each parameter's and buffer's value, looked up by its
fully-qualified name (FQN) in a *source* of full values:

* ``host_source`` -- the model file's ``build_model`` run once on the CPU under
  ``torch.manual_seed(seed)``: exactly the model file's own initialisation (custom inits,
  buffers such as causal masks).  The single-process reference builds its model the same way,
  so every layout starts from the same weights.  Costs the full model in host memory.
* ``per_module_source`` -- never builds the full model: parameters are created on the meta
  device while buffers stay real (``register_parameter`` is intercepted during
  ``build_model``); each parameter's owning module is copied alone to the CPU and
  re-initialised with its ``reset_parameters()`` under a seed derived from its FQN, so the
  value of a parameter does not depend on which other parameters this rank holds.  Parameters
  of modules without ``reset_parameters`` get N(0, 0.02) (GPT-2's init; Radford et al. 2019,
  code release) when they have two or more dimensions, ones for 1-D ``weight``, zeros else.
  Peak host memory: one module.  The model file's own custom init is NOT reproduced.

``auto`` uses the host source when the full parameters of the model, times the processes on
this node, fit in half of the host's available memory.

``--init-from PATH`` (``RunOptions.init_from``) replaces both with a weights file
(runtime/weights_in.py): a source whose ``read_local(fqn, tensor)`` fills a rank's tensor with
its own slices of the file, so no rank reads the full model; buffers the file lacks come from
the per-module source's buffers (the model file's own values; its parameters are never built).

Each rank keeps only its shard: for a DTensor parameter the full value is cut to the
parameter's placements locally (``distribute_tensor(..., src_data_rank=None)``: no
communication, every rank computes the same full value).
"""
from __future__ import annotations

import contextlib
import hashlib
import os
from typing import Callable, Iterator

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

from autopar.core.modelfile import ModelFile
from autopar.runtime.ties import TieGroup, aliases, canonical_fqn, retie

GPT2_INIT_STD = 0.02   # Radford et al. 2019 (GPT-2 code release): N(0, 0.02) weights

FullSource = Callable[[str], torch.Tensor]


def build_meta_model(model_file: ModelFile, model_args: dict) -> nn.Module:
    with torch.device("meta"):
        return model_file.build(**model_args)


def host_source(model_file: ModelFile, model_args: dict, seed: int) -> FullSource:
    """Full values from the model file's own init on the CPU (the reference uses the same)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with torch.device("cpu"):
            model = model_file.build(**model_args)
    values = {n: t.detach() for n, t in _named_tensors(model)}
    return lambda fqn: _lookup(values, fqn)


def per_module_source(model_file: ModelFile, model_args: dict, seed: int) -> FullSource:
    """Full values computed one module at a time, seeded by the module's FQN."""
    with _parameters_on_meta():
        skeleton = model_file.build(**model_args)
    buffers = {n: b.detach() for n, b in skeleton.named_buffers(remove_duplicate=False)}
    cache: dict[str, dict[str, torch.Tensor]] = {}

    def value(fqn: str) -> torch.Tensor:
        if fqn in buffers:
            return buffers[fqn]
        owner_path, _, leaf = fqn.rpartition(".")
        if owner_path not in cache:
            cache.clear()                       # keep one module's values alive at a time
            cache[owner_path] = _init_module_alone(skeleton.get_submodule(owner_path), owner_path, seed)
        return _lookup(cache[owner_path], leaf if owner_path else fqn)

    return value


def choose_source(mode: str, model_file: ModelFile, model_args: dict, seed: int,
                  meta_model: nn.Module, init_from=None) -> tuple[str, FullSource]:
    """(the init mode, its source); ``init_from``: a weights file or folder (runtime/weights_in.py),
    checked against ``meta_model`` here (a ``WeightsError`` before anything is allocated)."""
    if init_from is not None:
        from autopar.runtime.weights_in import weights_source

        return "init-from", weights_source(init_from, meta_model, per_module_source(model_file, model_args, seed))
    if mode == "auto":
        mode = "host" if _fits_in_host(meta_model) else "per-module"
    if mode == "host":
        return mode, host_source(model_file, model_args, seed)
    return mode, per_module_source(model_file, model_args, seed)


def materialize(module: nn.Module, device: torch.device, source: FullSource, ties: list[TieGroup] = (),
                swap: bool = True) -> None:
    """Allocate this rank's shards of ``module`` on ``device`` and fill them from ``source``.

    ``to_empty`` runs with ``swap_module_params_on_conversion``: each parameter object is kept
    (its storage swapped in place), so a parameter that several modules share stays shared and
    FSDP2 keeps the objects it manages.  ``retie`` then re-points any member of ``ties`` that an
    earlier step gave its own object, and a tied parameter takes the value of its group's
    canonical name (the same under every init source).

    ``swap=False`` replaces the parameter objects instead (``retie`` still restores the ties):
    under ``FakeTensorMode`` -- the dry run of a large model (runtime/dry_run.py)
    -- ``torch.utils.swap_tensors`` refuses to swap a meta parameter for a fake one."""
    previous = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(swap)
    try:
        module.to_empty(device=device)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(previous)
    retie(module, list(ties))
    fill_from_source(module, source, aliases(list(ties)))


@torch.no_grad()
def fill_from_source(module: nn.Module, source: FullSource, alias: dict[str, str] | None = None) -> None:
    alias = alias or {}
    read_local = getattr(source, "read_local", None)      # a source that reads a rank's slices itself
    for name, tensor in _named_tensors(module):
        fqn = canonical_fqn(name)
        if read_local is not None and read_local(alias.get(fqn, fqn), tensor):
            continue
        full = source(alias.get(fqn, fqn))
        if isinstance(tensor, DTensor):
            full = full.to(device=tensor.device, dtype=tensor.dtype)
            tensor.copy_(distribute_tensor(full, tensor.device_mesh, tensor.placements, src_data_rank=None))
        else:
            if tuple(full.shape) != tuple(tensor.shape):
                raise RuntimeError(f"materialise: {name} has shape {tuple(tensor.shape)} on this rank but "
                                   f"the full value has {tuple(full.shape)}")
            tensor.copy_(full)


# --------------------------------------------------------------------------- internals
def _named_tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from module.named_parameters(remove_duplicate=False)
    yield from module.named_buffers(remove_duplicate=False)


def _lookup(values: dict[str, torch.Tensor], fqn: str) -> torch.Tensor:
    try:
        return values[fqn]
    except KeyError:
        raise RuntimeError(f"materialise: the model has no parameter or buffer named {fqn!r}") from None


def _fqn_seed(seed: int, fqn: str) -> int:
    digest = hashlib.sha256(f"{seed}:{fqn}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _init_module_alone(meta_module: nn.Module, path: str, seed: int) -> dict[str, torch.Tensor]:
    """The module's own parameters (not its children's), initialised on the CPU by themselves."""
    own = {n: p for n, p in meta_module.named_parameters(recurse=False)}
    shell = nn.Module()
    for n, p in own.items():
        shell.register_parameter(n, nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="cpu")))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_fqn_seed(seed, path))
        reset = getattr(type(meta_module), "reset_parameters", None)
        if reset is not None:
            # run the module's own reset on a shallow stand-in that holds CPU parameters
            stand_in = object.__new__(type(meta_module))
            stand_in.__dict__.update(meta_module.__dict__)
            stand_in.__dict__["_parameters"] = {n: shell._parameters.get(n) for n in meta_module._parameters}
            stand_in.__dict__["_modules"] = {}
            reset(stand_in)
        else:
            for n, p in shell.named_parameters():
                if p.dim() >= 2:
                    nn.init.normal_(p, mean=0.0, std=GPT2_INIT_STD)
                elif n == "weight":
                    nn.init.ones_(p)
                else:
                    nn.init.zeros_(p)
    return {n: p.detach() for n, p in shell.named_parameters()}


@contextlib.contextmanager
def _parameters_on_meta():
    """Parameters registered during the block go to the meta device; buffers stay real."""
    original = nn.Module.register_parameter

    def register(self, name, param):
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        original(self, name, param)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def _fits_in_host(meta_model: nn.Module) -> bool:
    param_bytes = sum(p.numel() * p.element_size() for p in meta_model.parameters())
    local_procs = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    try:
        avail_bytes = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return True
    return param_bytes * local_procs < 0.5 * avail_bytes
