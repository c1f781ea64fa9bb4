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
