"""What one rank records of one ``verify`` run, and the run's result merged on rank 0.

Observation only: Megatron-LM's ``train_step`` is wrapped to time it and keep what it returns;
each optimizer's ``prepare_grads`` is wrapped to read the gradients it is about to use
(``param_grads``); Megatron's own schedule is timed by ``megatron_trace``, the plugin's by its
own tracing (``--pp-trace``: ``state.last_timeline``). Nothing a step computes changes.
"""

from __future__ import annotations

import time

import torch

from .. import device as device_helper
from ..runtime.trace import build_timeline
from ..schedules import build_schedule
from ..timeline import Timeline
from .megatron_trace import MegatronScheduleTracer
from .param_grads import global_names, local_squares, merge_norms
from .runs import VerifyRun


class RunRecorder:
    """One rank's record of one run (install it from ``run_pretrain_gpt``'s ``on_args``)."""

    def __init__(self, run: VerifyRun, device: torch.device, progress=None):
        self.run, self.device, self.progress = run, device, progress
        self.steps: list[dict] = []
        self.squares: list[list] = []
        self.pending: list = []
        self.names: dict | None = None
        self.timeline: dict | None = None  # the candidate's last traced step (pipeline rank 0)
        self.last_microbatches = 0
        self.chunks = 1
        self.tracer = (MegatronScheduleTracer(count_bytes=device.type == "cpu")
                       if run.schedule is None else None)

    def install(self, _args=None) -> None:
        from megatron.training import training

        original = training.train_step

        def train_step(*args, **kwargs):
            return self._step(original, args, kwargs)

        training.train_step = train_step
        if self.tracer is not None:
            self.tracer.install()

    def _step(self, original, args, kwargs):
        from megatron.core import parallel_state
        from megatron.core.num_microbatches_calculator import get_num_microbatches

        model = kwargs.get("model", args[2] if len(args) > 2 else None)
        optimizer = kwargs.get("optimizer", args[3] if len(args) > 3 else None)
        fbf = kwargs.get("forward_backward_func", args[6] if len(args) > 6 else None)
        if self.names is None:
            self._watch_gradients(model, optimizer)
        self.last_microbatches = get_num_microbatches()
        if self.tracer is not None:
            order = build_schedule(self.run.order, _pp_size(), self.last_microbatches,
                                   chunks=self.chunks if self.chunks > 1 else None)
            self.tracer.start_step(order, parallel_state.get_pipeline_model_parallel_rank())
        device_helper.start_memory_probe(self.device)
        device_helper.synchronize(self.device)
        start = time.perf_counter()
        out = original(*args, **kwargs)
        device_helper.synchronize(self.device)
        seconds = time.perf_counter() - start
        if self.tracer is not None:
            self.tracer.finish_step()
        self.steps.append(self._step_record(out, seconds, fbf))
        self.squares.append(self.pending)
        self.pending = []
        if self.progress is not None:
            self.progress(self.run, len(self.steps), self.steps[-1])
        return out

    def _watch_gradients(self, model, optimizer) -> None:
        from megatron.core import parallel_state

        p, rank = _pp_size(), parallel_state.get_pipeline_model_parallel_rank()

        def stage_of_chunk(index, inner):
            stage = getattr(inner, "pipeline_stage", None)
            return index * p + rank if stage is None else stage

        self.names = global_names(model, stage_of_chunk)
        self.chunks = len(model)
        for leaf in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
            self._wrap_prepare_grads(leaf)

    def _wrap_prepare_grads(self, leaf) -> None:
        original = leaf.prepare_grads

        def prepare_grads(*args, **kwargs):
            self.pending.extend(local_squares(leaf, self.names))
            return original(*args, **kwargs)

        leaf.prepare_grads = prepare_grads

    def _step_record(self, out, seconds: float, fbf) -> dict:
        loss_dict, skipped, grad_norm = out[0], out[1], out[5]
        state = getattr(fbf, "state", None)  # the plugin's
        timeline = getattr(state, "last_timeline", None)
        if timeline is not None:
            self.timeline = timeline.to_dict()
        peak = device_helper.allocator_peak_bytes(self.device)
        if peak is None:  # the CPU: the activation bytes held
            last = getattr(state, "last_step", None)
            peak = (self.tracer.peak_bytes if self.tracer is not None
                    else getattr(last, "peak_bytes", None))
        loss = loss_dict.get("lm loss") if isinstance(loss_dict, dict) else None
        return {"loss": None if loss is None else float(loss),
                "grad_norm": None if grad_norm is None else float(grad_norm),
                "skipped": int(skipped), "microbatches": self.last_microbatches,
                "seconds": seconds, "peak_bytes": peak}

    def payload(self) -> dict:
        from megatron.core import parallel_state as ps

        return {"rank": torch.distributed.get_rank(), "pp": ps.get_pipeline_model_parallel_rank(),
                "tp": ps.get_tensor_model_parallel_rank(), "dp": ps.get_data_parallel_rank(),
                "ep": ps.get_expert_model_parallel_rank(), "steps": self.steps,
                "squares": self.squares, "timeline": self.timeline, "chunks": self.chunks,
                "trace": (self.tracer.payload(ps.get_pipeline_model_parallel_rank())
                          if self.tracer is not None else None)}

    def gather(self) -> dict | None:
        """Every rank's record to rank 0 (one all-gather on the world group): the merged run
        there, None elsewhere."""
        payloads = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(payloads, self.payload())
        if torch.distributed.get_rank() != 0:
            return None
        return merge_run(self.run, payloads, self.last_microbatches)


def _pp_size() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_pipeline_model_parallel_world_size()


def merge_run(run: VerifyRun, payloads: list[dict], microbatches: int) -> dict:
    """The run as one record: per step the loss (a last pipeline rank's), the grad norm, the
    step time (the slowest rank's), the microbatches; every parameter's gradient norm per
    step; the peak memory per pipeline rank; the last step's measured timeline."""
    first = min(payloads, key=lambda p: p["rank"])
    losses = next((p for p in payloads if any(s["loss"] is not None for s in p["steps"])), first)
    steps = []
    for k, step in enumerate(first["steps"]):
        steps.append({**step, "loss": losses["steps"][k]["loss"],
                      "seconds": max(p["steps"][k]["seconds"] for p in payloads)})
    norms = [merge_norms([(p["pp"], p["tp"], p["ep"], p["squares"][k]) for p in payloads])
             for k in range(len(steps))]
    peaks: dict[int, int] = {}
    for p in payloads:
        for step in p["steps"]:
            if step["peak_bytes"] is not None:
                peaks[p["pp"]] = max(peaks.get(p["pp"], 0), int(step["peak_bytes"]))
    return {"name": run.name, "title": run.title, "schedule": run.schedule, "order": run.order,
            "argv": list(run.argv), "steps": steps, "param_norms": norms,
            "peak_bytes": [peaks.get(r) for r in range(max(p["pp"] for p in payloads) + 1)],
            "timeline": _timeline(run, payloads, microbatches)}


def _timeline(run: VerifyRun, payloads: list[dict], microbatches: int) -> dict | None:
    """The last step's measured timeline of the first replica (dp 0, tp 0)."""
    if run.schedule is not None:
        return next((p["timeline"] for p in payloads if p["timeline"] is not None), None)
    traces = [p["trace"] for p in payloads if p["dp"] == 0 and p["tp"] == 0]
    if not traces or any(t is None for t in traces):
        return None
    chunks = payloads[0]["chunks"]
    schedule = build_schedule(run.order, len(traces), microbatches,
                              chunks=chunks if chunks > 1 else None)
    timeline: Timeline = build_timeline(schedule, traces)
    timeline.schedule = run.title
    return timeline.to_dict()
