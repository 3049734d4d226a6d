"""Whether a captured model can take context parallelism, and if not, why.

Context parallelism (runtime/apply_cp.py) splits every sample's tokens over the cp ranks in
the head-tail layout and computes attention over the whole sequence by gathering K and V.  It
needs, from the captured graph (core/graph.py):

* a sequence dimension: ``OpGraph.seq_len`` (the tokens per sample capture found on the
  inputs).  The runtime slices every input and target whose dim 1 has that length; the
  positions come from ``position_ids`` (a forward that takes them) or from the forward's own
  ``torch.arange`` of the sequence length -- capture lists those as ``torch.arange`` /
  ``aten.arange`` ops;
* attention through ``F.scaled_dot_product_attention`` -- ops of kind ``"attention"``, the
  one op the runtime replaces.  Attention written as explicit ``matmul`` + ``softmax`` (the
  zoo's nanoGPT, examples/gpt.py's default ``attention="math"``) would run on the rank's own
  tokens only: it is refused, not silently trained as another model;
* a sequence of ``2 cp`` equal chunks (the head-tail split of Brandon et al. 2023 / torch's
  ``_HeadTailLoadBalancer``): ``seq_len % (2 cp) == 0``.

The attention's masks are checked when it runs (an explicit ``attn_mask``, e.g. padding, is
refused there: capture traces HF models through ``torch.export``, which records SDPA with the
mask transformers builds for tracing, so the graph cannot tell a causal mask from padding).
"""
from __future__ import annotations

from autopar.core.graph import OpGraph


def attention_ops(graph: OpGraph) -> list:
    return [o for o in graph.ops if o.kind == "attention"]


def cp_refusal(graph: OpGraph, cp: int) -> str | None:
    """Why ``graph`` cannot run with context-parallel degree ``cp`` (one sentence), or ``None``."""
    if cp == 1:
        return None
    if graph.seq_len is None:
        return ("its inputs have no sequence dimension (capture found no tokens-per-sample length), so there is "
                "nothing to split over the cp ranks")
    if not attention_ops(graph):
        mixes = [o for o in graph.ops if o.kind == "matmul"]
        how = (f"it computes attention as explicit matmul and softmax ({mixes[0].target} in "
               f"{mixes[0].module_path or 'the root module'})" if mixes else "it has no attention op")
        return (f"{how}; context parallelism replaces F.scaled_dot_product_attention calls with attention over the "
                f"whole sequence, so attention written otherwise would see only the rank's own tokens. Call "
                f"F.scaled_dot_product_attention in the model (as examples/gpt.py does with attention='sdpa')")
    if graph.seq_len % (2 * cp):
        return (f"its sequence of {graph.seq_len} tokens does not split into 2 x cp = {2 * cp} equal chunks "
                f"(the load-balanced head-tail layout)")
    return None


def cp_degrees(graph: OpGraph, world_size: int) -> tuple[int, ...]:
    """The context-parallel degrees the planner searches for ``graph``: 1, and each power of two
    up to the world the model takes (``cp_refusal``: a sequence of 2 cp equal chunks, attention
    through SDPA).  Powers of two as for tp (heads, hidden sizes and sequence lengths are)."""
    out, c = [1], 2
    while c <= world_size:
        if world_size % c == 0 and cp_refusal(graph, c) is None:
            out.append(c)
        c *= 2
    return tuple(out)
