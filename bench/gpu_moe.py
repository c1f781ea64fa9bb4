"""The GPU check's MoE overlap on CUDA streams (issue 26; part of the check's part 2): one MoE
layer's F&B pair as Megatron's per-layer plan orders it (``TransformerLayerSchedulePlan.run``),
the all-to-alls on a communication stream, the rest on the compute stream, the plan's
dependencies as CUDA events; each node a GPU sleep of its cost (one GPU has no all-to-all peer:
the latency is what is emulated, as in bench (h)'s threads):

    comm stream:  combine(b)    dispatch(f)    dispatch(b)    combine(f)
    comp stream:  attention(f)  experts(b)     experts(f)     attention(b)

Timed with CUDA events: the same nodes on one stream (the all-to-alls exposed), on two (the
pair), and without the all-to-alls (the floor). Hidden = (alone - paired) / (alone - floor);
the check passes at 80 % or more (the issue's target for a whole step is this, per pair).
"""

from __future__ import annotations

import torch

LAYERS = 8
TARGET = 0.8


def _node(stream, cycles: int, after=()):
    """Enqueue one node (a GPU sleep) on ``stream`` after ``after``'s events; its end event."""
    done = torch.cuda.Event()
    with torch.cuda.stream(stream):
        for event in after:
            stream.wait_event(event)
        torch.cuda._sleep(cycles)
        done.record(stream)
    return done


def _pair_layer(comp, comm, c: int, a: int, half_b: int, start) -> object:
    """One layer of the pair on two streams; returns the event its last node records."""
    combine_b = _node(comm, a, [start])
    attention_f = _node(comp, c // 2, [start])
    dispatch_f = _node(comm, a, [attention_f])
    experts_b = _node(comp, half_b, [combine_b])
    dispatch_b = _node(comm, a, [experts_b])
    experts_f = _node(comp, c // 2, [dispatch_f])
    combine_f = _node(comm, a, [experts_f])
    attention_b = _node(comp, half_b, [dispatch_b])
    return _node(comp, 0, [attention_b, combine_f])  # the layer ends when both streams do


def _alone_layer(comp, c: int, a: int, half_b: int, start) -> object:
    """The same nodes one after the other on one stream (``a = 0``: the floor)."""
    event = start
    for cycles in (c // 2, a, c // 2, a, a, half_b, a, half_b):  # F's four nodes, then B's
        event = _node(comp, cycles, [event])
    return event


def _timed(device, run) -> float:
    """Milliseconds from a start event to ``run(start)``'s end event."""
    comp = torch.cuda.current_stream(device)
    start, begin = torch.cuda.Event(enable_timing=True), torch.cuda.Event()
    begin.record(comp)
    start.record(comp)
    end_node = begin
    for _ in range(LAYERS):
        end_node = run(end_node)
    comp.wait_event(end_node)
    end = torch.cuda.Event(enable_timing=True)
    end.record(comp)
    torch.cuda.synchronize(device)
    return start.elapsed_time(end)


def moe_pair_check(device: torch.device, c_cycles: int = 4_000_000,
                   share: float = 0.3) -> tuple[bool, str]:
    """(passed, detail): what one F&B pair hides of its all-to-alls on CUDA streams."""
    a, half_b = int(share * c_cycles), c_cycles  # a full B: twice a forward's compute
    with torch.cuda.device(device):
        comp, comm = torch.cuda.current_stream(device), torch.cuda.Stream(device=device)
        runs = {"floor": lambda s: _alone_layer(comp, c_cycles, 0, half_b, s),
                "alone": lambda s: _alone_layer(comp, c_cycles, a, half_b, s),
                "paired": lambda s: _pair_layer(comp, comm, c_cycles, a, half_b, s)}
        for run in runs.values():  # warm-up
            _timed(device, run)
        ms = {name: min(_timed(device, run) for _ in range(3)) for name, run in runs.items()}
    hidden = (ms["alone"] - ms["paired"]) / (ms["alone"] - ms["floor"])
    detail = (f"MoE F&B pair in Megatron's plan order on two CUDA streams ({LAYERS} layers, "
              f"all-to-all {share:.0%} of a forward's compute): floor {ms['floor']:.2f} ms, "
              f"all-to-alls exposed {ms['alone']:.2f} ms, paired {ms['paired']:.2f} ms: "
              f"{hidden:.0%} hidden (target {TARGET:.0%})")
    return hidden >= TARGET, detail


__all__ = ["moe_pair_check", "LAYERS", "TARGET"]
