"""Placeholder: DualPipeV builder (being written)."""
from ..ir import ScheduleError


def build_dualpipev(num_ranks, num_microbatches, chunks=2, **options):
    raise ScheduleError("dualpipev is not built yet")
