"""One pass ``Schedule -> Program``: the P2P program the executor runs (it interprets it: see
``runtime/executor.py``), derived from the action lists alone (no torch), in time linear in the
number of actions.

Per rank it walks the action list with one inbox rule (a peer's messages are received in the
order that peer sends them) and these posting rules:

- before action i: with a lockstep posting, its receive-only batches for the rounds the rank
  sits idle (``LockstepPosting.before[i]``);
- the action's input: posted now if no receive from that peer is in flight, then waited on
  (earlier messages from the same peer are waited on first and held);
- a B or I waits first for the send of the activation it consumes the gradient of
  (Megatron's ``deallocate_output_tensor`` frees it only once sent);
- ``post_ahead`` (NCCL, where ``lowering`` proved it safe and faster): the next action's
  receive, when it will not go fused with this action's send, is posted before this action
  computes;
- DualPipe's F&B pairs (a lockstep posting built with them, ``LockstepPosting.pairs``): an F
  and the B or I right after it, on another stage, run as one pair, both inputs received
  first; both sends then go in one batch with the round's receives;
- DualPipe's commit (``commit_pairs``, the same pairs without rounds): every action's (or
  pair's) sends go in one batch with the receives of what follows it, whichever way they go,
  and a pair's inputs are received in one batch before it; a rank waits only for the ranks
  its messages go to or come from;
- the action computes;
- its send goes in one batch with the next action's receive when they go opposite ways
  (Megatron's ``send_forward_recv_backward`` / ``send_backward_recv_forward``), or, with a
  lockstep posting, with the receives of its round (``LockstepPosting.after[i]``);
- ``prefetch`` (gloo, in memory: transports whose receives do not queue behind sends, and no
  timer times the calls): after that, the next action's receive, when not fused, is posted at
  once, so the peer's send is not held up while this rank finishes its bookkeeping;
- at the end of the step, every send not yet waited on is waited on.

Every ``Wait`` names the op it waits for (``Wait.op``); ``Program.action_starts`` marks where
each action's steps begin (the runtime runs the action's hooks there, before its receives, as
Megatron does). ``variable_shapes``: each call first exchanges its shape headers in a batch of
its own and waits on it (the transport's NCCL path does this inside each call, so the program
the executor interprets is lowered without them).
"""

from __future__ import annotations

from ..ir import BACKWARD_WEIGHT, FORWARD, Schedule
from ..program import RECV, SEND, Batch, Compute, P2POp, Post, Program, Wait
from .messages import (ACTIVATION, GRADIENT, CommPlan, Inbox, LockstepPosting, Message,
                       call_name, comm_plan, sent_to_each_rank)


def op_label(message: Message) -> str:
    """What an op carries, the same text on both sides, e.g. ``forward 3F2``."""
    kind = "F" if message.carries == ACTIVATION else "B"
    return f"{message.carries} {message.stage}{kind}{message.microbatch}"


def torch_op_name(message: Message, kind: str) -> str:
    """torch.distributed.pipelining's name of one side: SEND_F/SEND_B name the sending
    stage, RECV_F/RECV_B the receiving one (``message.stage`` is the receiving stage)."""
    forward = message.carries == ACTIVATION
    stage = message.stage
    if kind == SEND:
        stage += -1 if forward else 1
    return f"{stage}{kind.upper()}_{'F' if forward else 'B'}{message.microbatch}"


class _Ops:
    """Each op once: a message's send and receive (and their shape headers) are the same
    ``P2POp`` wherever they are posted, so a large program holds one object and one label
    per op, not one per use; Megatron's call names once per combination."""

    def __init__(self):
        self.ops: dict[tuple, P2POp] = {}
        self.calls: dict[tuple, str] = {}

    def op_of(self, message: Message, kind: str, header: bool) -> P2POp:
        key = (message, kind, header)
        op = self.ops.get(key)
        if op is None:
            what, prefix = ("shape of ", "HEADER_") if header else ("", "")
            op = self.ops[key] = P2POp(kind, message.peer, what + op_label(message),
                                       prefix + torch_op_name(message, kind))
        return op


class _RankPass:
    """One rank's walk; ``steps`` is its part of the program."""

    def __init__(self, schedule: Schedule, rank: int, plans: list[CommPlan],
                 incoming: dict[int, list[Message]], lockstep: LockstepPosting | None,
                 post_ahead: bool, variable_shapes: bool, prefetch: bool, shared: _Ops,
                 commit_pairs: frozenset[int] | None = None):
        self.op_of, self.calls = shared.op_of, shared.calls
        self.rank, self.schedule = rank, schedule
        self.actions = schedule.actions[rank]
        self.neighbours = schedule.neighbours()  # stage -> (upstream, downstream)
        self.plans = plans
        self.lockstep = lockstep
        # DualPipe's commit (``commit_pairs`` given, no lockstep posting)
        self.commit = commit_pairs is not None and lockstep is None
        self.commit_pairs = commit_pairs if self.commit else frozenset()
        self.post_ahead = post_ahead and lockstep is None
        self.prefetch = prefetch and lockstep is None
        self.variable_shapes = variable_shapes
        self.inbox = Inbox(incoming)  # a receive in flight is (its batch, its op)
        self.unsent: dict[tuple[int, int], Message] = {}  # (batch, op) of an unwaited send
        self.unsent_activation: dict[tuple[int, int], tuple] = {}  # (stage, mb) -> (batch, op)
        self.local: set[tuple] = set()  # tensors handed over between this rank's stages
        self.steps: list = []
        self.starts: list[int] = []
        self.batches = 0

    # ---------------------------------------------------------------- posting and waiting
    def _batch(self, ops: list[P2POp], call: str) -> int:
        index = self.batches
        self.batches += 1
        self.steps.append(Post(Batch(self.rank, index, ops, call)))
        return index

    def _ops(self, sends: list[Message], recvs: list[Message], header: bool) -> list[P2POp]:
        return [*(self.op_of(m, SEND, header) for m in sends),
                *(self.op_of(m, RECV, header) for m in recvs)]

    def _post(self, sends: list[Message], recvs: list[Message]) -> None:
        """One batch: ``sends`` first, then ``recvs``."""
        if not sends and not recvs:
            return
        kinds = (*[m.carries for m in sends], None, *[m.carries for m in recvs])
        name = self.calls.get(kinds)
        if name is None:
            name = self.calls[kinds] = call_name(sends, recvs)
        if self.variable_shapes:
            header = self._batch(self._ops(sends, recvs, True), f"{name} (shapes)")
            self.steps.append(Wait(header, "the shape headers"))
        index = self._batch(self._ops(sends, recvs, False), name)
        for k, message in enumerate(recvs):
            self.inbox.posted(message, (index, len(sends) + k))
        for k, send in enumerate(sends):
            self.unsent[(index, k)] = send
            if send.carries == ACTIVATION:
                self.unsent_activation[(send.stage, send.microbatch)] = (index, k)

    def _take(self, needed: Message) -> None:
        inbox = self.inbox
        while needed not in inbox.stash:
            if not inbox.in_flight[needed.peer]:
                self._post([], [inbox.next_from(needed.peer)])
            message, (index, op) = inbox.oldest_in_flight(needed.peer)
            self.steps.append(Wait(index, op=op))
            inbox.stash.add(message)
        inbox.stash.remove(needed)

    def _finish_send(self, key: tuple[int, int]) -> None:
        message = self.unsent.pop(key)
        if message.carries == ACTIVATION:
            self.unsent_activation.pop((message.stage, message.microbatch), None)
        self.steps.append(Wait(key[0], op=key[1]))

    # ---------------------------------------------------------------- one action's steps
    def _input(self, i: int) -> None:
        """Receive (or take over locally) action i's input; before a B or I, wait for the
        send of the activation whose gradient it computes."""
        action, plan = self.actions[i], self.plans[i]
        if plan.recv is not None:
            self._take(plan.recv)
        else:
            self.local.discard(_local_key(action))
        after = self.neighbours[action.stage][1]
        if action.kind != FORWARD and after is not None:
            key = self.unsent_activation.get((after, action.microbatch))
            if key is not None:
                self._finish_send(key)

    def _hand_over(self, i: int) -> None:
        """Action i's output, where its consumer is on this rank: held for it."""
        action = self.actions[i]
        if self.plans[i].send is None:
            before, after = self.neighbours[action.stage]
            if action.kind == FORWARD and after is not None:
                self.local.add((ACTIVATION, after, action.microbatch))
            elif action.kind not in (FORWARD, BACKWARD_WEIGHT) and before is not None:
                self.local.add((GRADIENT, before, action.microbatch))

    def _output(self, i: int) -> None:
        """Action i's output: handed over on this rank, or sent (fused, in its round)."""
        plan = self.plans[i]
        self._hand_over(i)
        sends = [plan.send] if plan.send is not None else []
        if self.lockstep is not None:
            self._post(sends, list(self.lockstep.after.get(i, [])))
            return
        if self.commit:  # the send with the next action's (or pair's) receives, any direction
            self._post(sends, self._to_receive(i + 1, 2 if i + 1 in self.commit_pairs else 1))
            return
        next_recv = self.plans[i + 1].recv if i + 1 < len(self.actions) else None
        fused = None
        if plan.send is not None and next_recv is not None \
                and next_recv.carries != plan.send.carries:
            fused = self.inbox.to_post(next_recv)
        self._post(sends, [fused] if fused is not None else [])
        if self.prefetch and fused is None and next_recv is not None:
            early = self.inbox.to_post(next_recv)
            if early is not None:
                self._post([], [early])

    def _pair_output(self, i: int) -> None:
        """The outputs of the pair (i, i + 1): both sends in one batch with the round's
        receives, or (``commit_pairs``) with the receives of what comes next: the next pair's
        two inputs, or the next action's (one commit, as DualPipe's)."""
        self._hand_over(i)
        self._hand_over(i + 1)
        sends = [p.send for p in self.plans[i:i + 2] if p.send is not None]
        if self.lockstep is not None:
            self._post(sends, list(self.lockstep.after.get(i + 1, [])))
            return
        self._post(sends, self._to_receive(i + 2, 2 if i + 2 in self.commit_pairs else 1))

    def _to_receive(self, i: int, count: int) -> list[Message]:
        """What to receive now so that the inputs of actions i .. i + count - 1 are posted:
        from each peer, in its sending order, up to the input (nothing for an input already
        posted or here)."""
        inbox, out = self.inbox, []
        for plan in self.plans[i:i + count]:
            needed = plan.recv
            if needed is None or needed in inbox.stash or needed in out or any(
                    m == needed for m, _ in inbox.in_flight[needed.peer]):
                continue
            taken = sum(1 for m in out if m.peer == needed.peer)  # already in this batch
            queue = inbox.queues[needed.peer]
            for k in range(taken, len(queue)):
                out.append(queue[k])
                if queue[k] == needed:
                    break
        return out

    def _pairs_with_next(self, i: int) -> bool:
        """DualPipe's pair: where the lockstep rounds pair action i with the next one."""
        if self.lockstep is not None:
            return i in self.lockstep.pairs
        return i in self.commit_pairs

    def run(self) -> tuple[list, list[int]]:
        for _ in self.walk():
            pass
        return self.steps, self.starts

    def walk(self):
        """Lower action by action, yielding after each (``steps`` grows as it goes), so a
        check can stop as soon as a program is known to hang."""
        n, i = len(self.actions), 0
        while i < n:
            self.starts.append(len(self.steps))
            if self.lockstep is not None:
                for messages in self.lockstep.before.get(i, ()):
                    self._post([], list(messages))
            pair = self._pairs_with_next(i)
            if pair and self.commit:  # the pair's inputs in one batch, first
                self._post([], self._to_receive(i, 2))
            self._input(i)
            if pair:
                self.starts.append(len(self.steps))
                self._input(i + 1)
                self.steps.append(Compute(str(self.actions[i]), paired=True))
                self.steps.append(Compute(str(self.actions[i + 1])))
                self._pair_output(i)
                i += 2
                yield
                continue
            if self.post_ahead and i + 1 < n:
                needed, send = self.plans[i + 1].recv, self.plans[i].send
                if needed is not None and (send is None or send.carries == needed.carries):
                    early = self.inbox.to_post(needed)
                    if early is not None:
                        self._post([], [early])
            self.steps.append(Compute(str(self.actions[i])))
            self._output(i)
            i += 1
            yield
        for key in list(self.unsent):
            self._finish_send(key)
        if self.inbox.stash:
            raise RuntimeError(
                f"rank {self.rank}: messages were left unconsumed at the end of the step: "
                f"{sorted(map(str, self.inbox.stash))} (the schedule lacks their consumers)")


def _local_key(action) -> tuple:
    kind = ACTIVATION if action.kind == FORWARD else GRADIENT
    return (kind, action.stage, action.microbatch)


def lower_program(schedule: Schedule, name: str, postings: list | None = None,
                  post_ahead: bool = False, variable_shapes: bool = False,
                  prefetch: bool = False,
                  plans: list[list[CommPlan]] | None = None,
                  commit_pairs: list[frozenset[int]] | None = None) -> Program:
    """The program (see the module docstring); ``postings``: each rank's lockstep posting, or
    None for Megatron's fused calls; ``plans``: every rank's ``comm_plan``, when the caller
    has them; ``commit_pairs``: with the fused calls, each rank's F&B pairs (the i whose
    action runs with action i + 1), posted as DualPipe commits them."""
    program, feeds = lower_program_lazily(schedule, name, postings, post_ahead,
                                          variable_shapes, prefetch, plans, commit_pairs)
    for feed in feeds:
        for _ in feed:
            pass
    return program


def lower_program_lazily(schedule: Schedule, name: str, postings: list | None = None,
                         post_ahead: bool = False, variable_shapes: bool = False,
                         prefetch: bool = False,
                         plans: list[list[CommPlan]] | None = None,
                         commit_pairs: list[frozenset[int]] | None = None
                         ) -> tuple[Program, list]:
    """``lower_program``'s program with every rank's steps still empty, and per rank a feed
    (an iterator) whose every step lowers one more action into them: a check that plays the
    program (``nccl_rules.check_nccl_rules(program, feeds)``) lowers only as far as it gets."""
    plans = plans or [comm_plan(schedule, rank) for rank in range(schedule.num_ranks)]
    incoming = sent_to_each_rank(schedule, plans=plans)
    program, shared, feeds = Program(name), _Ops(), []
    for rank in range(schedule.num_ranks):
        walk = _RankPass(schedule, rank, plans[rank], incoming[rank],
                         postings[rank] if postings else None, post_ahead, variable_shapes,
                         prefetch, shared,
                         None if commit_pairs is None else commit_pairs[rank])
        program.steps.append(walk.steps)
        program.action_starts.append(walk.starts)
        feeds.append(walk.walk())
    return program, feeds
