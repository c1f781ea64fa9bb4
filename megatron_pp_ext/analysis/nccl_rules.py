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
from .nccl_play import NcclPlay

@gc_paused
def check_nccl_rules(program: Program, feeds: list | None = None) -> None:
    """Raise ``ScheduleError`` if ``program`` can hang or mismatch messages under NCCL.
    ``feeds``: per rank, an iterator that extends the rank's steps as it is advanced
    (``program_pass.lower_program_lazily``): the play lowers only as far as it gets, so a
    program that hangs early costs only its start; one that passes ends lowered whole."""
    RulesPlay(program, feeds).check()


def _check_pairing(program: Program) -> None:
    """Per ordered pair, as many sends as receives, the k-th of each carrying the same
    message: asked where a play is stuck (a play that finishes matched every op one to one,
    and compared each pair's messages as it matched them)."""
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
                raise ScheduleError(_mismatch(program, pair, k, a, b))
        if len(sent) != len(received):
            raise ScheduleError(
                f"{program.name}: rank {pair[0]} sends {len(sent)} message(s) to rank "
                f"{pair[1]}, which receives {len(received)}: the extra ones never complete")


def _mismatch(program: Program, pair: tuple[int, int], k: int, sent: tuple,
              received: tuple) -> str:
    """The error for a pair's k-th send and receive, each (label, batch), that differ."""
    return (f"{program.name}: NCCL matches the messages from rank {pair[0]} to rank "
            f"{pair[1]} in posting order, but send #{k} is {sent[0]} ({sent[1]}) while "
            f"receive #{k} expects {received[0]} ({received[1]}): the data would land in the "
            "wrong buffer")


class RulesPlay(NcclPlay):
    """Plays every rank's program under NCCL's rules (``nccl_play``) until all finish or
    nothing moves; explains where it is stuck."""

    def check(self) -> None:
        stuck = self.play()
        if stuck:  # a message sent and never received, or the wrong one, says it better
            _check_pairing(self.program)
            raise ScheduleError(self._explain(stuck))

    def on_mismatch(self, pair: tuple[int, int], k: int, send: tuple, recv: tuple) -> None:
        (sb, si), (rb, ri) = send, recv
        raise ScheduleError(_mismatch(self.program, pair, k, (sb.ops[si].label, sb),
                                      (rb.ops[ri].label, rb)))

    # ------------------------------------------------------------------ the error
    def _pending_ops(self, rank: int) -> list[tuple[P2POp, str]]:
        """The running batch's unfinished ops, each with why its partner is not running."""
        posted = self.posted[rank]
        if self.head[rank] >= len(posted):
            return []
        batch, out = posted[self.head[rank]], []
        for i, op in enumerate(batch.ops):
            if self.op_done(batch, i):
                continue
            out.append((op, self._partner_state(rank, batch, i)))
        return out

    def _partner_state(self, rank: int, batch: Batch, i: int) -> str:
        op = batch.ops[i]
        pair = (rank, op.peer) if op.kind == SEND else (op.peer, rank)
        mine = self.sends.get(pair, []) if op.kind == SEND else self.recvs.get(pair, [])
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
           "RulesPlay", "check_nccl_rules"]
