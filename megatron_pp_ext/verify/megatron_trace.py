"""The measured timeline of Megatron's own schedule, so the reference run draws, costs and
measures as the plugin's traced runs do.

Megatron's 1F1B and interleaved schedules call ``schedules.forward_step`` and
``schedules.backward_step`` (module globals) once per forward and per backward of a
microbatch. The tracer times each call on this rank and labels the k-th forward (backward)
with the k-th F (B) of the plugin's schedule of the same name, whose order is Megatron's
(``1f1b``; ``interleaved``, Megatron's order exactly). On the CPU it also counts the activation
bytes each forward saves until its backward (``runtime.memory.ActivationMemory``, as the
executor does). A step whose calls do not match the order (Megatron's combined 1F1B under
``--overlap-moe-expert-parallel-comm`` calls neither) is reported untraced.

Times are ``time.perf_counter`` on the host, as the executor's tracing: on a GPU they are when
the work was issued, which the blocking receives keep close to when it ran.
"""

from __future__ import annotations

import time

from ..ir import BACKWARD, FORWARD, Schedule
from ..runtime.memory import ActivationMemory
from ..runtime.trace import clock_offset
from ..timeline import COMPUTE


class MegatronScheduleTracer:
    """Times this rank's forward and backward steps under Megatron's own schedule."""

    def __init__(self, count_bytes: bool):
        self.count_bytes = count_bytes
        self.forwards: list = []
        self.backwards: list = []
        self.events: list[tuple] = []
        self.done = {FORWARD: 0, BACKWARD: 0}
        self.memory: ActivationMemory | None = None
        self.peak_bytes: int | None = None
        self.matched = True

    def install(self) -> None:
        from megatron.core.pipeline_parallel import schedules

        forward, backward = schedules.forward_step, schedules.backward_step

        def traced_forward(*args, **kwargs):
            start = time.perf_counter()
            out = forward(*args, **kwargs)
            self._done(FORWARD, start, out[0] if isinstance(out, tuple) else out)
            return out

        def traced_backward(*args, **kwargs):
            start = time.perf_counter()
            out = backward(*args, **kwargs)
            self._done(BACKWARD, start, None)
            return out

        schedules.forward_step, schedules.backward_step = traced_forward, traced_backward

    def start_step(self, schedule: Schedule, pp_rank: int) -> None:
        """Before a training step that runs ``schedule`` (the plugin's schedule of Megatron's
        order, for this step's microbatch count)."""
        row = schedule.actions[pp_rank]
        self.forwards = [a for a in row if a.kind == FORWARD]
        self.backwards = [a for a in row if a.kind == BACKWARD]
        self.events, self.matched = [], True
        self.done = {FORWARD: 0, BACKWARD: 0}
        self.memory = ActivationMemory() if self.count_bytes else None
        self.peak_bytes = None

    def _done(self, kind: str, start: float, output) -> None:
        end = time.perf_counter()
        actions = self.forwards if kind == FORWARD else self.backwards
        done = self.done[kind]
        if done >= len(actions):  # not the order we expected: the step stays untraced
            self.matched = False
            return
        self.done[kind] = done + 1
        action = actions[done]
        self.events.append((str(action), start, end, COMPUTE))
        if self.memory is not None:
            if kind == FORWARD:
                self.memory.record_forward(action.stage, action.microbatch, output)
            else:
                self.memory.after_backward(action.stage, action.microbatch, kind)
            self.peak_bytes = max(self.peak_bytes or 0, self.memory.sample())

    def finish_step(self) -> None:
        if self.memory is not None:
            self.memory.release_all()
        complete = len(self.events) == len(self.forwards) + len(self.backwards)
        self.matched = self.matched and complete

    def payload(self, pp_rank: int) -> dict | None:
        """This rank's events of the last step, in ``runtime.trace.rank_payload``'s form, or
        None when the step did not follow the order."""
        if not self.matched:
            return None
        return {"rank": pp_rank, "events": list(self.events), "peak_activations": 0,
                "peak_bytes": self.peak_bytes, "offset": clock_offset()}
