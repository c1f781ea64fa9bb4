"""What tensor, context and expert parallelism send inside a layer, and the pipeline's messages,
in seconds on a machine (``machines``): a collective over a group that fits in a node runs at
NVLink's bandwidth, one that crosses nodes at the NIC's (the data sheets' figures, one
direction). Megatron's rank order puts tp innermost, then cp, then dp, pp outermost; the
experts' grid etp, then ep.

* **TP** (tp > 1), per layer, T x h 16-bit activations: with sequence parallelism an
  all-gather before QKV and fc1 and a reduce-scatter after the projection and fc2 in the
  forward (2 in a MoE layer, whose tokens go to the experts from their sequence shard), 6 in
  the backward (the input gathered again for the weight gradient); without it two all-reduces
  each way. A ring collective moves (tp - 1) / tp of the tensor. With ``--tp-comm-overlap``
  Transformer Engine runs each beside the GEMM that consumes or produces it: exposed is the
  part the GEMM does not cover, and at least the ring's first step (1/tp of it).
* **CP** (cp > 1), per layer: the ring exchange of K and V (cp - 1 steps of the local
  tokens' K and V), twice in the backward (K, V and their gradients), beside the core
  attention: exposed is what the attention does not cover.
* **EP** (ep > 1), per MoE layer: the dispatch and the combine all-to-all of the token copies
  (T/tp x k x h, 16-bit) in the forward, again in the backward; the part bound for the node's
  own ranks at NVLink's bandwidth, the rest at the NIC's, whichever takes longer. Not
  overlapped (``--overlap-moe-expert-parallel-comm`` is not priced).
* **Pipeline**: one activation message (T/tp x h under sequence parallelism), NVLink when the
  next stage's rank is in the node, else the NIC.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .machines import Machine

if TYPE_CHECKING:
    from .model_shape import ModelShape


@dataclass(frozen=True)
class LayerMessages:
    tp_f: float = 0.0
    tp_b: float = 0.0
    cp_f: float = 0.0
    cp_b: float = 0.0
    ep_f: float = 0.0
    ep_b: float = 0.0


@dataclass(frozen=True)
class LayerComm:
    shape: "ModelShape"
    machine: Machine
    tp_overlap: bool = False

    def ring(self, nbytes: float, group: int, span: int) -> float:
        """A ring all-gather or reduce-scatter of ``nbytes`` (the whole tensor) over ``group``
        ranks spread over ``span`` consecutive ranks."""
        if group <= 1:
            return 0.0
        return (group - 1) / group * nbytes / self.machine.link_bytes_per_s(span)

    def layer(self, moe: bool, qkv: float, proj: float, mlp: float, attention_f: float,
              attention_b: float) -> LayerMessages:
        """One layer's exposed messages, given its GEMMs' and attention's seconds."""
        tp_f, tp_b = self._tensor_parallel(moe, qkv, proj, mlp)
        cp_f, cp_b = self._context_parallel(attention_f, attention_b)
        ep = self._all_to_all() if moe else 0.0
        return LayerMessages(tp_f, tp_b, cp_f, cp_b, 2 * ep, 2 * ep)

    def embedding_seconds(self) -> float:
        """The vocab-parallel embedding's reduce-scatter (all-reduce without SP)."""
        shape = self.shape
        one = self.ring(shape.tokens * shape.hidden * 2, shape.tp, shape.tp)
        return one if shape.sequence_parallel else 2 * one

    def pipeline_message(self, ranks_per_stage: int) -> float:
        """One activation message to the next stage, ``ranks_per_stage`` = tp x cp x dp
        ranks apart."""
        shape = self.shape
        tokens = shape.tokens / shape.tp if shape.sequence_parallel else shape.tokens
        nbytes = tokens * shape.hidden * 2
        return nbytes / self.machine.link_bytes_per_s(ranks_per_stage + 1)

    def _tensor_parallel(self, moe: bool, qkv: float, proj: float,
                         mlp: float) -> tuple[float, float]:
        shape = self.shape
        one = self.ring(shape.tokens * shape.hidden * 2, shape.tp, shape.tp)
        if not one:
            return 0.0, 0.0
        beside = [qkv, proj] + ([] if moe else [mlp / 2, mlp / 2])
        if not shape.sequence_parallel:  # an all-reduce is a reduce-scatter and an all-gather
            return len(beside) * one, len(beside) * one
        if self.tp_overlap:
            exposed = sum(max(one / shape.tp, one - gemm) for gemm in beside)
        else:
            exposed = len(beside) * one
        return exposed, 1.5 * exposed  # the backward: 6 collectives for the forward's 4

    def _context_parallel(self, attention_f: float, attention_b: float) -> tuple[float, float]:
        shape = self.shape
        if shape.cp <= 1:
            return 0.0, 0.0
        step = shape.tokens * 2 * shape.kv_size / shape.tp * 2  # K and V, 16-bit
        rate = self.machine.link_bytes_per_s(shape.tp * shape.cp)
        forward = (shape.cp - 1) * step / rate
        return max(0.0, forward - attention_f), max(0.0, 2 * forward - attention_b)

    def _all_to_all(self) -> float:
        shape = self.shape
        if shape.ep <= 1:
            return 0.0
        tokens = shape.tokens / shape.tp if shape.tp > 1 else shape.tokens
        nbytes = tokens * shape.topk * shape.hidden * 2
        in_node = max(1, min(shape.ep, self.machine.gpus_per_node // max(1, shape.etp)))
        local = nbytes * (in_node - 1) / shape.ep / self.machine.nvlink_bytes_per_s
        remote = nbytes * (shape.ep - in_node) / shape.ep / self.machine.network_bytes_per_s
        return max(local, remote)


__all__ = ["LayerComm", "LayerMessages"]
