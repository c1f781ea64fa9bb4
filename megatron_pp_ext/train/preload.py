"""Imported by the ``train`` ranks' process server before it forks a rank
(``train.processes._PRELOAD``), and by a rank started on its own (srun) with ``train.loop``:
Megatron-Core's modules that a rank uses, imported without compiling its fusions where there is
no GPU (``integration.megatron_import``: 2.8 s less CPU per process here)."""

from __future__ import annotations

from ..integration.megatron_import import import_megatron

import_megatron()
