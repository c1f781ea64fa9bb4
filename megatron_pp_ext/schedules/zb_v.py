"""Placeholder: ZB-V builder (being written)."""
from ..ir import ScheduleError


def build_zb_v(num_ranks, num_microbatches, chunks=2, **options):
    raise ScheduleError("zb-v is not built yet")
