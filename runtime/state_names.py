"""The checkpoint's key of every state-dict entry: one name per tensor of the un-pipelined model.

A checkpoint must load under any other layout, so what it holds is keyed as the whole,
unsplit model would key it, whatever layout wrote it:

* fully-qualified names: pipeline stages keep the model's own module names
  (``apply_pp``), and ``get_model_state_dict`` strips the wrappers' prefixes (DDP's
  ``module.``, the checkpoint wrapper's);
* one key per tied parameter -- the group's *canonical* name, the first one
  ``named_parameters()`` reports on the model as built (``ties.find_ties``) --: a module's
  ``state_dict`` lists a tied parameter under each of its names, a stage cut from the export
  graph may hold it under any one of them, and its optimizer state is keyed by whichever name
  that part's ``named_parameters()`` reports first;
* a tied parameter that several pipeline stages hold as copies (``ties.untie_across_stages``,
  kept equal by ``TiedGradSum``) is saved by the first stage holding it only: the copies may
  even be laid out differently (a vocabulary-parallel head on the last stage, a whole
  embedding on the first), and DCP takes one layout per key.

On load every part asks for the canonical key of each of its entries, so a stage that holds a
tied copy under another name (the LM head) reads the value the embedding was saved with, in
its own layout.

Optimizer keys are DCP's flattened ones (``flatten_optimizer_state_dict``):
``state.<fqn>.<state name>`` and ``param_groups.<fqn>.<option>``, where neither the state
names (``step``, ``exp_avg``, ...) nor the options (``lr``, ``betas``, ...) hold a dot.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from autopar.runtime.ties import TieGroup, aliases

MODEL, OPTIM = "model", "optim"
_OPTIM_PREFIXES = ("state.", "param_groups.")


@dataclass(frozen=True)
class StateNames:
    """``aliases``: every tied name -> its canonical name; ``owner``: canonical name -> the
    pipeline stage that saves it, for parameters copied onto several stages; ``stages``: the
    stage index of each of this rank's parts, in the parts' order."""
    aliases: dict[str, str] = field(default_factory=dict)
    owner: dict[str, int] = field(default_factory=dict)
    stages: tuple[int, ...] = ()

    @classmethod
    def build(cls, ties: list[TieGroup], cross_stage_ties: list[tuple[TieGroup, list[int]]],
              stages: list[int]) -> "StateNames":
        return cls(aliases=aliases(ties), owner={group[0]: holders[0] for group, holders in cross_stage_ties},
                   stages=tuple(stages))

    def canonical_fqn(self, fqn: str) -> str:
        return self.aliases.get(fqn, fqn)

    def canonical_key(self, kind: str, key: str) -> tuple[str, str]:
        """(checkpoint key, canonical parameter name) of ``key`` of a model (``MODEL``) or
        flattened optimizer (``OPTIM``) state dict."""
        prefix, fqn, leaf = _split(kind, key)
        fqn = self.canonical_fqn(fqn)
        return f"{prefix}{fqn}{leaf}", fqn

    def saves(self, fqn: str, part_index: int) -> bool:
        """Whether this rank's part ``part_index`` writes the entries of parameter ``fqn``
        (a canonical name)."""
        stage = self.stages[part_index] if part_index < len(self.stages) else 0
        return self.owner.get(fqn, stage) == stage


def _split(kind: str, key: str) -> tuple[str, str, str]:
    """key = prefix + fqn + leaf."""
    if kind == OPTIM:
        for prefix in _OPTIM_PREFIXES:
            if key.startswith(prefix):
                fqn, dot, leaf = key[len(prefix):].rpartition(".")
                if dot:
                    return prefix, fqn, dot + leaf
        return key, "", ""
    return "", key, ""


def canonical_states(names: StateNames, kind: str, part_states: list[dict], *, for_save: bool) -> tuple[dict, list[dict]]:
    """Merge this rank's parts' state dicts (one per part, keyed by the parts' own names) into
    one keyed by canonical names.

    Returns (the merged dict, per part {own key: canonical key}).  ``for_save``: a tied copy
    is left out on the stages that do not own it, and a parameter listed under several names
    in one part is kept once.  The merged dict holds the first part's value of a key; on load
    a later part of this rank asking for the same key reads it from there through its key map
    (``checkpointing.load_checkpoint`` converts it to that part's layout)."""
    merged: dict = {}
    keys: list[dict] = []
    for index, state in enumerate(part_states):
        mine = {}
        for key, value in state.items():
            canon, fqn = names.canonical_key(kind, key)
            mine[key] = canon
            if for_save and not names.saves(fqn, index):
                continue
            merged.setdefault(canon, value)
        keys.append(mine)
    return merged, keys
