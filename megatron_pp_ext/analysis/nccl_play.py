"""Play a lowered P2P program under NCCL's rules, event by event: the one engine behind
``nccl_rules.check_nccl_rules`` (can it hang?) and ``nccl_timing.time_program`` (how long
does it take?).

The rules (DESIGN.md, "NCCL's rules"): a rank's host runs its steps in order and blocks at a
``Wait`` until that batch has completed; a rank's batches run one after another on one
stream (a batch runs once it is posted and the one before it has completed); rendezvous: the
k-th send from a to b completes together with b's k-th receive from a, only while both their
batches run; a batch completes when all its ops have.

Work is driven by what changed, not by rounds over every rank and pair: a host is advanced
when one of its batches completes, a pair is matched when a batch with one of its ops starts
to run. Each step, op and batch is then handled a bounded number of times, so a play costs
time linear in the program (the round-based play it replaces cost rounds x pairs: 2.0 s of
CPU to check zb-v at p=64, m=512, this one 0.7 s). Every
enabled move stays enabled until it is taken, so the end state (finished, or where it is
stuck) does not depend on the order moves are taken in.

Hooks (``on_post``, ``on_start``, ``on_transfer``, ``on_complete``, ``on_compute``,
``on_wait``) let a subclass keep clocks; the base keeps none. ``on_mismatch``: a pair's k-th
send and receive carry different messages (compared as they match). Pure: no torch.
"""

from __future__ import annotations

from ..program import SEND, Batch, Compute, Post, Program, Wait


class NcclPlay:
    """One play of ``program``. ``feeds``: per rank, an iterator that lowers one more action
    into the rank's steps each time it is advanced (``program_pass.lower_program_lazily``),
    so a play that gets stuck early lowers only that far."""

    def __init__(self, program: Program, feeds: list | None = None):
        self.program = program
        n = len(program.steps)
        self.feeds = list(feeds) if feeds is not None else [None] * n
        self.host = [0] * n  # next step of each rank's host
        self.posted: list[list[Batch]] = [[] for _ in range(n)]  # stream order
        self.head = [0] * n  # the running batch (index into posted), once posted
        self.left: list[dict[int, int]] = [{} for _ in range(n)]  # batch -> ops not done
        self.done: list[set[int]] = [set() for _ in range(n)]  # completed batch indexes
        # (src, dst) -> [(src batch, op index)] / [(dst batch, op index)] in posting order
        self.sends: dict[tuple[int, int], list] = {}
        self.recvs: dict[tuple[int, int], list] = {}
        self.matched: dict[tuple[int, int], int] = {}  # (src, dst) -> pairs completed
        self._hosts: list[int] = list(range(n - 1, -1, -1))  # ranks whose host may move
        self._pairs: list[tuple[int, int]] = []  # pairs that may match

    # ---------------------------------------------------------------- hooks (no clocks)
    def on_post(self, rank: int, batch: Batch) -> None: ...
    def on_start(self, rank: int, batch: Batch, previous: Batch | None) -> None: ...
    def on_transfer(self, send: tuple, recv: tuple) -> None: ...
    def on_complete(self, rank: int, batch: Batch) -> None: ...
    def on_compute(self, rank: int, step: Compute) -> None: ...
    def on_wait(self, rank: int, step: Wait) -> None: ...
    def on_mismatch(self, pair: tuple[int, int], k: int, send: tuple, recv: tuple) -> None:
        """The pair's k-th send and receive carry different messages."""

    # ---------------------------------------------------------------- the play
    def play(self) -> list[int]:
        """Play until nothing moves; the ranks left unfinished (host or stream), in order."""
        hosts, pairs = self._hosts, self._pairs
        while hosts or pairs:
            while hosts:
                self._advance_host(hosts.pop())
            while pairs:
                self._transfer(pairs.pop())
        return [r for r in range(len(self.host))
                if self.host[r] < len(self.program.steps[r])
                or self.head[r] < len(self.posted[r])]

    def _more(self, rank: int) -> bool:
        """Whether the rank's program has a step at its host: lowered further if need be."""
        steps = self.program.steps[rank]
        while self.host[rank] >= len(steps):
            feed = self.feeds[rank]
            if feed is None:
                return False
            if next(feed, StopIteration) is StopIteration:
                self.feeds[rank] = None
        return True

    def _advance_host(self, rank: int) -> None:
        steps, done = self.program.steps[rank], self.done[rank]
        on_wait, on_compute, post = self.on_wait, self.on_compute, self._post
        k, n = self.host[rank], len(steps)
        while True:
            if k >= n:  # lowered as far as it goes: lower more, if it can
                if not self._more(rank):
                    break
                n = len(steps)
            step = steps[k]
            kind = type(step)
            if kind is Wait:
                if step.batch not in done:
                    break
                on_wait(rank, step)
            elif kind is Post:
                post(rank, step.batch)
            elif kind is Compute:
                on_compute(rank, step)
            k += 1
            self.host[rank] = k
        self.host[rank] = k

    def _post(self, rank: int, batch: Batch) -> None:
        posted = self.posted[rank]
        posted.append(batch)
        self.left[rank][batch.index] = len(batch.ops)
        sends, recvs = self.sends, self.recvs
        for i, op in enumerate(batch.ops):
            if op.kind == SEND:
                queue = sends.get((rank, op.peer))
                if queue is None:
                    queue = sends[(rank, op.peer)] = []
            else:
                queue = recvs.get((op.peer, rank))
                if queue is None:
                    queue = recvs[(op.peer, rank)] = []
            queue.append((batch, i))
        self.on_post(rank, batch)
        if self.head[rank] == len(posted) - 1:  # its stream was idle: it runs at once
            self._start(rank, None if len(posted) == 1 else posted[-2])

    def _start(self, rank: int, previous: Batch | None) -> None:
        """The rank's head batch starts to run: its pairs may now match."""
        batch = self.posted[rank][self.head[rank]]
        self.on_start(rank, batch, previous)
        if not batch.ops:
            self._complete(rank, batch)
            return
        pairs = self._pairs
        for op in batch.ops:
            pairs.append((rank, op.peer) if op.kind == SEND else (op.peer, rank))

    def _transfer(self, pair: tuple[int, int]) -> None:
        sends, recvs = self.sends.get(pair), self.recvs.get(pair)
        if not sends or not recvs:
            return
        posted, head, left = self.posted, self.head, self.left
        k, end = self.matched.get(pair, 0), min(len(sends), len(recvs))
        while k < end:
            send, recv = sends[k], recvs[k]
            for batch, _ in (send, recv):  # both must be their rank's running batch
                r = batch.rank
                if head[r] >= len(posted[r]) or posted[r][head[r]] is not batch:
                    return
            if send[0].ops[send[1]].label != recv[0].ops[recv[1]].label:
                self.on_mismatch(pair, k, send, recv)
            k += 1
            self.matched[pair] = k
            self.on_transfer(send, recv)
            for batch, _ in (send, recv):  # an op done; the batch, once all of its are
                ops_left = left[batch.rank]
                ops_left[batch.index] -= 1
                if not ops_left[batch.index]:
                    self._complete(batch.rank, batch)

    def _complete(self, rank: int, batch: Batch) -> None:
        self.done[rank].add(batch.index)
        self.on_complete(rank, batch)
        self._hosts.append(rank)
        self.head[rank] += 1
        if self.head[rank] < len(self.posted[rank]):
            self._start(rank, batch)

    def op_done(self, batch: Batch, op: int) -> bool:
        """Whether op ``op`` of ``batch`` has completed (for the messages of a stuck play):
        the k-th op of a pair completes with the pair's k-th match."""
        if batch.index in self.done[batch.rank]:
            return True
        o = batch.ops[op]
        pair = (batch.rank, o.peer) if o.kind == SEND else (o.peer, batch.rank)
        mine = (self.sends if o.kind == SEND else self.recvs).get(pair, [])
        k = next(k for k, (b, j) in enumerate(mine) if b is batch and j == op)
        return k < self.matched.get(pair, 0)


__all__ = ["NcclPlay"]
