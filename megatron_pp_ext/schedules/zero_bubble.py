"""Placeholder: ZB-H1 / ZB-H2 builders (being written)."""
from ..ir import ScheduleError


def build_zb_h1(num_ranks, num_microbatches, chunks=1, **options):
    raise ScheduleError("zb-h1 is not built yet")


def build_zb_h2(num_ranks, num_microbatches, chunks=1, **options):
    raise ScheduleError("zb-h2 is not built yet")
