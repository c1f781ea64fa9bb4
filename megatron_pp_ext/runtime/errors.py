"""Errors the runtime raises, each naming who waited for what."""

from __future__ import annotations


class PipelineTimeoutError(RuntimeError):
    """A wait on a pipeline peer expired: names this rank, the peer, the pending action."""

    def __init__(self, rank: int, peer: int, pending: str, waited_s: float, recent: list[str]):
        self.rank, self.peer, self.pending, self.recent = rank, peer, pending, recent
        self.waited_s = waited_s
        history = " ".join(recent[-32:]) or "(none)"
        super().__init__(
            f"pipeline rank {rank} waited {waited_s:.1f} s for rank {peer} and gave up: pending "
            f"{pending}. Rank {peer} may have died, hung, or be running a different schedule. "
            f"Last actions of rank {rank}: {history}"
        )


class PeerReported(Exception):
    """Raised by a transport's watch while waiting: pipeline rank ``peer`` reported a failure
    (its note); the executor turns it into a ``PeerFailedError`` naming what was pending."""

    def __init__(self, peer: int, note: str):
        super().__init__(note)
        self.peer, self.note = peer, note


class PeerFailedError(PipelineTimeoutError):
    """A peer failed and said so while this rank waited: raised at once, not after the
    timeout, naming this rank, the pending action and the peer's own report."""

    def __init__(self, rank: int, peer: int, pending: str, waited_s: float, recent: list[str],
                 note: str):
        super().__init__(rank, peer, pending, waited_s, recent)
        self.cause = note  # like PeerLostError: the peer is gone, no reason to wait for it
        history = " ".join(recent[-32:]) or "(none)"
        self.args = (
            f"pipeline rank {rank} stopped after {waited_s:.1f} s: pending {pending}, and "
            f"rank {peer} reported a failure: {note}. Last actions of rank {rank}: {history}",)
