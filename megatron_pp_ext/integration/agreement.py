"""What the ranks of a pipeline tell each other outside the schedule's own messages.

1. Agreement before the first step. Ranks that call with different settings (one rank with
   num_microbatches=4, the others with 8; another schedule; other options) would exchange
   mismatched messages and hang. Before the first step of each distinct setting the ranks
   all-gather a fingerprint of it (one int64 per rank on the communication device); on a
   mismatch they all-gather the settings themselves and EVERY rank raises the same
   ``ValueError`` naming the disagreeing ranks and their values.

2. Failure notes after a failed step. A rank that loses a peer (its process died) or times
   out writes one line into the process group's key-value store, and a rank that fails
   reads its peers' lines, so the rank that merely waited on a healthy-but-failed neighbour
   can still name the rank that died first. Best effort: a store that does not answer within
   two seconds is skipped.

   Which rank failed first must not depend on which of two timeouts fires first. A rank that
   timed out on a peer that is still alive therefore waits (bounded) for that peer's own note
   before it names suspects: if the peer is itself blocked on someone, its wait started before
   ours expired, so it expires (and writes its note) within one timeout of ours; a peer that
   writes nothing in that window is hung itself. A lost connection needs no wait: a rank that
   fails publishes its note before its process exits and closes the connection.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import threading
import time

import torch
from ..runtime.errors import PeerFailedError, PeerReported

logger = logging.getLogger("megatron_pp_ext")

FINGERPRINT_FIELDS = ("schedule", "pipeline_size", "num_microbatches", "model_chunks",
                      "forward_only", "tensor_shape", "pipeline_dtype", "variable_seq_lengths")


class AgreementTimeoutError(TimeoutError):
    """Not every rank of the pipeline group reached the agreement before the first step."""


def settings(schedule: str, pipeline_size: int, num_microbatches: int, model_chunks: int,
             forward_only: bool, tensor_shape, pipeline_dtype, variable_seq_lengths: bool,
             options: dict) -> dict:
    """The values every rank of a pipeline must share, as plain (printable) values."""
    values = {
        "schedule": str(schedule),
        "pipeline_size": int(pipeline_size),
        "num_microbatches": int(num_microbatches),
        "model_chunks": int(model_chunks),
        "forward_only": bool(forward_only),
        "tensor_shape": None if tensor_shape is None else tuple(int(d) for d in tensor_shape),
        "pipeline_dtype": str(pipeline_dtype).replace("torch.", ""),
        "variable_seq_lengths": bool(variable_seq_lengths),
    }
    values.update({key: value for key, value in sorted(options.items()) if key != "schedule"})
    return values


def fingerprint(values: dict) -> int:
    """A signed 64-bit digest of ``values``, the same in every process (unlike ``hash``)."""
    text = repr(sorted(values.items())).encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "little", signed=True)


def _who(ranks: list[int], global_ranks: list[int] | None) -> str:
    names = []
    for r in ranks:
        if global_ranks is not None and global_ranks[r] != r:
            names.append(f"{r} (global rank {global_ranks[r]})")
        else:
            names.append(str(r))
    return f"rank {names[0]} has" if len(names) == 1 else f"ranks {', '.join(names)} have"


def describe_disagreement(values_by_rank: list[dict], global_ranks: list[int] | None = None) -> str:
    """The error text for ranks whose settings differ: each differing setting, with the ranks
    holding each of its values (most common value first), then the rule and the fix."""
    keys = list(dict.fromkeys(k for values in values_by_rank for k in values))
    parts = []
    for key in keys:
        groups: dict[str, list[int]] = {}
        for rank, values in enumerate(values_by_rank):
            groups.setdefault(repr(values.get(key, "<missing>")), []).append(rank)
        if len(groups) < 2:
            continue
        ordered = sorted(groups.items(), key=lambda item: (-len(item[1]), item[1][0]))
        parts.append(", ".join(
            f"{_who(ranks, global_ranks)} {key}={_plain(values_by_rank[ranks[0]].get(key))}"
            for _, ranks in ordered))
    if not parts:
        parts = ["the settings' fingerprints differ"]
    return (
        "pipeline ranks disagree before the first step: " + "; ".join(parts) + ". Every rank "
        "of a pipeline group must call forward_backward_func with the same schedule, "
        "num_microbatches, model chunks per rank, forward_only, tensor shape (seq_length, "
        "micro_batch_size, hidden_size), config.pipeline_dtype, config.variable_seq_lengths "
        "and plugin options (install(...) / ScheduleFunction(...)); make them agree on every "
        "rank (same launch arguments and environment)."
    )


def _plain(value) -> str:
    return value if isinstance(value, str) else repr(value)


def _wait(work, timeout_s: float, polled: bool) -> bool:
    """Wait for an async collective; False if it did not finish within ``timeout_s``."""
    import datetime

    if not polled:
        try:
            return work.wait(timeout=datetime.timedelta(seconds=max(timeout_s, 0.001))) is not False
        except RuntimeError as exc:
            if "timed out" in str(exc).lower() or "timeout" in str(exc).lower():
                return False
            raise
    deadline = time.monotonic() + timeout_s
    while not work.is_completed():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.0005)
    work.wait()
    return True


def check_agreement(values: dict, pp_group, rank: int, device: torch.device,
                    timeout_s: float = 600.0, polled: bool = False,
                    purpose: str = "the schedule", who: str = "pipeline",
                    describe=None) -> None:
    """Collective over ``pp_group``: raise ``ValueError`` on every rank if the ranks' ``values``
    differ. Costs one all-gather of one int64 per rank when they agree. ``polled``: wait by
    polling (NCCL, whose waits do not block the host). Another group whose ranks must agree
    (an expert group) passes ``purpose`` (what they agree on), ``who`` (its ranks' name) and
    ``describe(values_by_rank, global_ranks)`` (the error's text)."""
    import torch.distributed as dist

    size = dist.get_world_size(pp_group)
    publish_host()
    mine = torch.tensor([fingerprint(values)], dtype=torch.int64, device=device)
    gathered = [torch.zeros_like(mine) for _ in range(size)]
    started = time.monotonic()
    try:
        work = dist.all_gather(gathered, mine, group=pp_group, async_op=True)
        finished = _wait(work, timeout_s, polled)
    except RuntimeError as exc:
        raise AgreementTimeoutError(
            f"{who} rank {rank} lost a peer while the {who} ranks agreed on {purpose} "
            f"before the first step ({' '.join(str(exc).split())[:300]}): another rank died or "
            "raised before reaching this point; see its log") from exc
    if not finished:
        raise AgreementTimeoutError(
            f"{who} rank {rank} waited {time.monotonic() - started:.1f} s for the other "
            f"{size - 1} {who} ranks to agree on {purpose} before the first step: some "
            "rank did not call the pipelined forward_backward_func (it raised, died, or runs "
            "another code path); see the other ranks' logs")
    if len({int(t.item()) for t in gathered}) == 1:
        return
    values_by_rank: list = [None] * size
    dist.all_gather_object(values_by_rank, values, group=pp_group)
    try:
        global_ranks = dist.get_process_group_ranks(pp_group) if pp_group is not None else None
    except Exception:  # noqa: BLE001 - naming global ranks is a courtesy
        global_ranks = None
    raise ValueError((describe or describe_disagreement)(values_by_rank, global_ranks))


# ---------------------------------------------------------------- failure notes
_NOTE_PREFIX = "megatron_pp_ext/failure/"
_FAILURES = "megatron_pp_ext/failures"  # a counter: notes published so far, job-wide
_STORE_TIMEOUT_S = 2.0
_HOST_PREFIX = "megatron_pp_ext/host/"  # each rank's host, so a failure can name the peer's
_SETTLED = "megatron_pp_ext/settled"  # a counter: failed ranks done with the store, job-wide


def host_name() -> str:
    """This process's host: SLURM's node name under SLURM (on one machine's network
    namespaces every node has the same hostname), else the hostname."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def publish_host() -> None:
    """Write this rank's host into the default store (best effort, bounded)."""
    import torch.distributed as dist

    store = _store()
    if store is not None:
        _bounded(lambda: store.set(f"{_HOST_PREFIX}{dist.get_rank()}", host_name()))


def peer_hosts(pp_group, peers) -> dict[int, str]:
    """{pipeline rank: host} for ``peers`` that published theirs (bounded; may be partial)."""
    store, members = _store(), _members(pp_group)
    if store is None or members is None:
        return {}

    def read():
        hosts = {}
        for peer in (r for r in peers if 0 <= r < len(members)):
            key = f"{_HOST_PREFIX}{members[peer]}"
            if store.check([key]):
                hosts[peer] = store.get(key).decode(errors="replace")
        return hosts

    return _bounded(read) or {}


def settled() -> None:
    """Count this failed rank as done with the store (its note written, its peers' read)."""
    store = _store()
    if store is not None:
        _bounded(lambda: store.add(_SETTLED, 1))


def linger_if_serving_the_store(timeout_s: float, failure: BaseException | None = None,
                                quiet_s: float = _STORE_TIMEOUT_S) -> None:
    """On global rank 0, whose process serves the job's store under ``env://``, after a
    failure: wait until every rank that published a failure note has settled (explained its
    failure), and no new note came for ``quiet_s`` (a peer that failed a moment after this
    rank publishes a little later), at most a peer's explaining (one ``timeout_s`` wait on
    its own peer and four bounded store calls): this process exiting takes the store from
    peers still writing or reading notes (they would lose the reports, the suspects and the
    hosts). A rank on a lost node publishes nothing and is not waited for. ``failure`` (this
    rank's, explained) is logged first: a launcher that ends the job when a peer exits (srun
    --kill-on-bad-exit) may stop this process while it waits, before its traceback prints."""
    import torch.distributed as dist

    store = _store()
    if store is None or not dist.is_initialized() or dist.get_rank() != 0:
        return
    within_s = timeout_s + 4 * _STORE_TIMEOUT_S
    if failure is not None:
        logger.error("megatron-pp-ext: global rank 0 failed: %s: %s (it serves the job's "
                     "rendezvous store and stays up to %.0f s for its peers to explain theirs)",
                     type(failure).__name__, failure, within_s)
    deadline = time.monotonic() + within_s
    settled_since = None  # (counts, when): every note published so far has settled
    while time.monotonic() < deadline:
        counts = _bounded(lambda: (int(store.add(_FAILURES, 0)), int(store.add(_SETTLED, 0))))
        if counts is None:
            return
        failures, done = counts
        if done < failures:
            settled_since = None
        elif settled_since is None or settled_since[0] != counts:
            settled_since = (counts, time.monotonic())
        elif time.monotonic() - settled_since[1] >= quiet_s:
            return
        time.sleep(0.1)


def _store():
    try:
        from torch.distributed import distributed_c10d

        return distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no default group, or a torch without the helper
        return None


def _bounded(fn, timeout_s: float = _STORE_TIMEOUT_S, slot: list | None = None):
    """``fn()`` on a daemon thread; its result, or None if it raised or did not finish. With
    ``slot`` (a one-item list), at most one such call is out at a time: while the last one
    (kept in the slot) still runs, return None at once rather than pile up threads."""
    if slot is not None and slot[0] is not None and slot[0].is_alive():
        return None
    box: list = [None]

    def body():
        try:
            box[0] = fn()
        except Exception:  # noqa: BLE001 - a dead store must not mask the real error
            box[0] = None

    thread = threading.Thread(target=body, daemon=True, name="pp-failure-note")
    if slot is not None:
        slot[0] = thread
    thread.start()
    thread.join(timeout_s)
    return box[0]


def failure_note(exc: BaseException, rank: int) -> str:
    """One line for the peers: who this rank lost or gave up on, and what it was doing."""
    peer, pending = getattr(exc, "peer", None), getattr(exc, "pending", None)
    if peer is None or pending is None:
        return f"rank {rank} failed: {' '.join(str(exc).split())[:300]}"

    if isinstance(exc, PeerFailedError):
        return f"rank {rank} stopped because rank {peer} failed (pending {pending})"
    if getattr(exc, "cause", None) is not None:  # PeerLostError
        return f"rank {rank} lost its connection to rank {peer} (pending {pending})"
    return f"rank {rank} waited for rank {peer} and gave up (pending {pending})"


def publish_failure(pp_group, rank: int, note: str) -> None:
    """Write this rank's one-line failure note into the default store (best effort)."""
    import torch.distributed as dist

    store = _store()
    if store is None:
        return
    key = f"{_NOTE_PREFIX}{dist.get_rank()}"

    def write():
        # numbered, so a watch can tell a note of this failure from one of an earlier,
        # caught failure; a reader that sees the count before the note reads it next time
        number = int(store.add(_FAILURES, 1))
        store.set(key, f"{number}:{note}")

    _bounded(write)


def failures_published() -> int | None:
    """How many failure notes the job's ranks have published so far (None: no store)."""
    store = _store()
    if store is None:
        return None
    return _bounded(lambda: int(store.add(_FAILURES, 0)))


def peer_failure_watch(pp_group, rank: int, baseline: int):
    """A transport ``watch``: raises ``PeerReported`` naming the first peer of ``pp_group``
    whose failure note is numbered above ``baseline`` (``failures_published()`` when the run
    last went well: notes of earlier, caught failures do not count). Each call reads one
    counter from the store, on a thread of its own; while a read is still out (a store that
    does not answer), calls do nothing rather than pile up."""

    reading: list = [None]  # the read still out, if any

    def watch() -> None:
        now = _bounded(failures_published_now, slot=reading)
        if now is None or now <= baseline:
            return
        notes = peer_failures(pp_group, rank, newer_than=baseline)
        for peer in sorted(notes):
            raise PeerReported(peer, notes[peer])

    return watch


def failures_published_now() -> int:
    """``failures_published`` without the thread (for a caller that bounds it itself)."""
    return int(_store().add(_FAILURES, 0))


def _members(pp_group) -> list[int] | None:
    """Global ranks of ``pp_group`` by pipeline rank (None if they cannot be had)."""
    import torch.distributed as dist

    try:
        return dist.get_process_group_ranks(pp_group) if pp_group is not None else list(
            range(dist.get_world_size()))
    except Exception:  # noqa: BLE001
        return None


def await_peer_note(pp_group, peer: int, within_s: float) -> bool:
    """Wait up to ``within_s`` for pipeline rank ``peer``'s failure note; True if it came."""
    store, members = _store(), _members(pp_group)
    if store is None or members is None or not 0 <= peer < len(members):
        return False
    key = f"{_NOTE_PREFIX}{members[peer]}"

    def wait() -> bool:
        deadline = time.monotonic() + within_s
        while not store.check([key]):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True

    return bool(_bounded(wait, timeout_s=within_s + _STORE_TIMEOUT_S))


def peer_failures(pp_group, rank: int, newer_than: int | None = None) -> dict[int, str]:
    """Failure notes of the other ranks of ``pp_group``: {pipeline rank: note}; with
    ``newer_than``, only those numbered above it."""
    store, members = _store(), _members(pp_group)
    if store is None or members is None:
        return {}

    def read():
        notes = {}
        for pp_rank, global_rank in enumerate(members):
            key = f"{_NOTE_PREFIX}{global_rank}"
            if pp_rank != rank and store.check([key]):
                number, _, note = store.get(key).decode(errors="replace").partition(":")
                if newer_than is None or (number.isdigit() and int(number) > newer_than):
                    notes[pp_rank] = note
        return notes

    return _bounded(read) or {}


def explain_failure(exc: BaseException, pp_group, rank: int) -> None:
    """Publish ``exc`` as this rank's note and append what the peers reported (and who is
    suspected of failing first: a rank named as the lost peer that sent no note) to its
    message. Mutates ``exc`` in place; never raises. The rank then counts as settled."""
    try:
        _explain(exc, pp_group, rank)
    finally:
        settled()


def _explain(exc: BaseException, pp_group, rank: int) -> None:
    try:
        publish_failure(pp_group, rank, failure_note(exc, rank))
        peer = getattr(exc, "peer", None)
        if isinstance(peer, int) and getattr(exc, "cause", None) is None:
            # Timed out on a live peer: give it one timeout (plus the store's slack) to say
            # whether it waited on someone else (see the module docstring).
            await_peer_note(pp_group, peer, float(getattr(exc, "waited_s", 0.0)) +
                            _STORE_TIMEOUT_S)
        elif isinstance(peer, int):
            # Lost the connection: a dead peer sends nothing, but gloo also closes a rank's
            # connections when one of its waits times out, a moment before that rank
            # publishes why: the store's slack for that note.
            await_peer_note(pp_group, peer, _STORE_TIMEOUT_S)
        notes = peer_failures(pp_group, rank)
        if not notes:
            _name_hosts(exc, pp_group, rank, [peer] if isinstance(peer, int) else [])
            return
        named = {getattr(exc, "peer", None)}
        for note in notes.values():
            named.update(_peers_named(note))
        suspects = sorted(r for r in named if isinstance(r, int) and r != rank and r not in notes)
        extra = ". Reports from the other pipeline ranks: " + "; ".join(
            notes[r] for r in sorted(notes)) + "."
        if suspects:
            extra += (f" Suspected to have failed first: rank(s) {suspects} (named as lost by "
                      "a peer, and sent no report).")
        exc.args = (str(exc) + extra,) + tuple(exc.args[1:])
        exc.peer_reports = notes
        exc.suspects = suspects
        _name_hosts(exc, pp_group, rank, sorted({peer, *suspects} - {None}))
    except Exception:  # noqa: BLE001 - explaining must never replace the real error
        return


def _name_hosts(exc: BaseException, pp_group, rank: int, peers: list[int]) -> None:
    """Append where ``peers`` (and this rank) run: on a cluster the lost rank's host is what
    the user looks for. ``exc.peer_hosts`` collects them."""
    hosts = peer_hosts(pp_group, peers)
    if not hosts:
        return
    where = ", ".join(f"rank {r} on host {hosts[r]}" for r in sorted(hosts))
    exc.args = (f"{exc} Hosts: {where}; rank {rank} (this one) on host {host_name()}.",) + \
        tuple(exc.args[1:])
    exc.peer_hosts = {**getattr(exc, "peer_hosts", {}), **hosts}


def _peers_named(note: str) -> set[int]:
    import re

    found = set()
    for pattern in (r"lost its connection to rank (\d+)", r"waited for rank (\d+)",
                    r"because rank (\d+) failed"):
        found.update(int(m) for m in re.findall(pattern, note))
    return found


__all__ = [
    "AgreementTimeoutError", "FINGERPRINT_FIELDS", "settings", "fingerprint",
    "describe_disagreement", "check_agreement", "publish_failure", "peer_failures",
    "await_peer_note", "explain_failure", "failures_published", "peer_failure_watch",
    "host_name", "publish_host", "peer_hosts", "settled", "linger_if_serving_the_store",
]
