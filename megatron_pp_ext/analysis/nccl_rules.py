"""Check a lowered P2P program against NCCL's rules, before any rank sends a byte.

A *program* is, per rank, the order in which the rank posts P2P batches and waits on them
(``Post`` / ``Wait`` steps, with ``Compute`` steps in between for the reader). NCCL's rules,
as modelled here (DESIGN.md, "NCCL's rules"):

* per ordered pair of ranks, the k-th send from a to b is matched with b's k-th receive from
  a (no tags): the two must carry the same message;
* a rank's batches run one after another on one stream: a batch starts only when the
  rank's previous batch has completed (and the rank has posted it);
* rendezvous: an op completes only while its matching op's batch is running; a batch
  completes when all its ops have;
* a rank's host blocks at a ``Wait`` until that batch has completed.

``check_nccl_rules`` plays every rank's program under these rules with no buffering at all
(NCCL buffers small messages, real activations are not small) and raises ``ScheduleError``
naming the ranks, the pending ops and the cycle if the program can hang, or if a pair's
messages would be matched with the wrong ones. Pure: no torch, no communication.
"""

from __future__ import annotations

from collections import defaultdict

from ..ir import ScheduleError
from ..program import RECV, SEND, Batch, Compute, P2POp, Post, Program, Wait
from .gc_pause import gc_paused

@gc_paused
def check_nccl_rules(program: Program, feeds: list | None = None) -> None:
    """Raise ``ScheduleError`` if ``program`` can hang or mismatch messages under NCCL.
    ``feeds``: per rank, an iterator that extends the rank's steps as it is advanced
    (``program_pass.lower_program_lazily``): the play lowers only as far as it gets, so a
    program that hangs early costs only its start; one that passes ends lowered whole."""
    if feeds is None:
        _check_pairing(program)
        _Player(program).play()
        return
    _Player(program, feeds).play()
    _check_pairing(program)


def _check_pairing(program: Program) -> None:
    """Per ordered pair, the k-th send and the k-th receive carry the same message."""
    sends, recvs = defaultdict(list), defaultdict(list)
    for rank, steps in enumerate(program.steps):
        for step in steps:
            if isinstance(step, Post):
                for op in step.batch.ops:
                    if op.kind == SEND:
                        sends[(rank, op.peer)].append((op.label, step.batch))
                    else:
                        recvs[(op.peer, rank)].append((op.label, step.batch))
    for pair in sorted(set(sends) | set(recvs)):
        sent, received = sends.get(pair, []), recvs.get(pair, [])
        for k, (a, b) in enumerate(zip(sent, received)):
            if a[0] != b[0]:
                raise ScheduleError(
                    f"{program.name}: NCCL matches the messages from rank {pair[0]} to rank "
                    f"{pair[1]} in posting order, but send #{k} is {a[0]} ({a[1]}) while "
                    f"receive #{k} expects {b[0]} ({b[1]}): the data would land in the wrong "
                    "buffer")
        if len(sent) != len(received):
            raise ScheduleError(
                f"{program.name}: rank {pair[0]} sends {len(sent)} message(s) to rank "
                f"{pair[1]}, which receives {len(received)}: the extra ones never complete")


class _Player:
    """Plays every rank's program under NCCL's rules until all finish or nothing moves."""

    def __init__(self, program: Program, feeds: list | None = None):
        self.program = program
        n = len(program.steps)
        self.feeds = list(feeds) if feeds is not None else [None] * n
        self.host = [0] * n  # next step of each rank's host
        self.posted: list[list[Batch]] = [[] for _ in range(n)]
        self.head = [0] * n  # each rank's running batch (index into posted), stream order
        self.done: set[tuple[int, int]] = set()  # (rank, batch index) completed
        self.op_done: set[tuple[int, int, int]] = set()  # (rank, batch index, op index)
        # (src, dst) -> [(src batch, op index)] / [(dst batch, op index)] in posting order
        self.sends = defaultdict(list)
        self.recvs = defaultdict(list)
        self.matched = defaultdict(int)  # (src, dst) -> pairs already completed

    def play(self) -> None:
        moved = True
        while moved:
            moved = any([self._advance_host(r) for r in range(len(self.host))])
            moved |= self._transfer()
            moved |= self._complete_heads()
        stuck = [r for r in range(len(self.host))
                 if self.host[r] < len(self.program.steps[r])
                 or self.head[r] < len(self.posted[r])]
        if stuck:
            raise ScheduleError(self._explain(stuck))

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

    def _advance_host(self, rank: int) -> bool:
        steps, moved = self.program.steps[rank], False
        while self._more(rank):
            step = steps[self.host[rank]]
            if isinstance(step, Wait) and (rank, step.batch) not in self.done:
                break
            if isinstance(step, Post):
                batch = step.batch
                self.posted[rank].append(batch)
                for i, op in enumerate(batch.ops):
                    pair = (rank, op.peer) if op.kind == SEND else (op.peer, rank)
                    (self.sends if op.kind == SEND else self.recvs)[pair].append((batch, i))
            self.host[rank] += 1
            moved = True
        return moved

    def _running(self, batch: Batch) -> bool:
        posted = self.posted[batch.rank]
        head = self.head[batch.rank]
        return head < len(posted) and posted[head] is batch

    def _transfer(self) -> bool:
        """Complete every matched send/receive whose two batches are both running."""
        moved = False
        for pair in list(self.sends):
            sends, recvs = self.sends[pair], self.recvs.get(pair, [])
            k = self.matched[pair]
            while k < len(sends) and k < len(recvs):
                (sb, si), (rb, ri) = sends[k], recvs[k]
                if not (self._running(sb) and self._running(rb)):
                    break
                self.op_done.add((sb.rank, sb.index, si))
                self.op_done.add((rb.rank, rb.index, ri))
                k += 1
                moved = True
            self.matched[pair] = k
        return moved

    def _complete_heads(self) -> bool:
        moved = False
        for rank, posted in enumerate(self.posted):
            while self.head[rank] < len(posted):
                batch = posted[self.head[rank]]
                if not all((rank, batch.index, i) in self.op_done for i in range(len(batch.ops))):
                    break
                self.done.add((rank, batch.index))
                self.head[rank] += 1
                moved = True
        return moved

    # ------------------------------------------------------------------ the error
    def _pending_ops(self, rank: int) -> list[tuple[P2POp, str]]:
        """The running batch's unfinished ops, each with why its partner is not running."""
        posted = self.posted[rank]
        if self.head[rank] >= len(posted):
            return []
        batch, out = posted[self.head[rank]], []
        for i, op in enumerate(batch.ops):
            if (rank, batch.index, i) in self.op_done:
                continue
            out.append((op, self._partner_state(rank, batch, i)))
        return out

    def _partner_state(self, rank: int, batch: Batch, i: int) -> str:
        op = batch.ops[i]
        pair = (rank, op.peer) if op.kind == SEND else (op.peer, rank)
        mine = self.sends[pair] if op.kind == SEND else self.recvs[pair]
        theirs = self.recvs.get(pair, []) if op.kind == SEND else self.sends.get(pair, [])
        k = next(k for k, (b, j) in enumerate(mine) if b is batch and j == i)
        if k >= len(theirs):
            return f"rank {op.peer} has not posted its matching op yet (its host is blocked)"
        other, _ = theirs[k]
        ahead = self.posted[op.peer][self.head[op.peer]] if self.head[op.peer] < len(
            self.posted[op.peer]) else None
        return (f"its match is in rank {op.peer}'s batch #{other.index}, queued behind "
                f"{'batch #' + str(ahead.index) if ahead else 'nothing'} on that rank's stream")

    def _explain(self, stuck: list[int]) -> str:
        lines = [f"{self.program.name} can hang under NCCL's rules (rendezvous sends, one "
                 "stream of batches per rank, no buffering):"]
        edges = {}
        for rank in stuck:
            steps = self.program.steps[rank]
            if self.host[rank] < len(steps):
                wait = steps[self.host[rank]]
                lines.append(f"  rank {rank}'s host waits on its batch #{wait.batch}"
                             + (f" ({wait.why})" if wait.why else ""))
            for op, state in self._pending_ops(rank):
                lines.append(f"    running: {op.kind} {op.label} "
                             f"{'to' if op.kind == SEND else 'from'} rank {op.peer}: {state}")
                edges.setdefault(rank, op.peer)
        cycle = _cycle(edges)
        if cycle:
            lines.append("  cycle: " + " -> ".join(f"rank {r}" for r in cycle))
        return "\n".join(lines)


def _cycle(edges: dict[int, int]) -> list[int]:
    for start in edges:
        seen, node = [], start
        while node in edges and node not in seen:
            seen.append(node)
            node = edges[node]
        if node in seen:
            return seen[seen.index(node):] + [node]
    return []


__all__ = ["SEND", "RECV", "P2POp", "Batch", "Post", "Wait", "Compute", "Program",
           "check_nccl_rules"]
