"""``python -m megatron_pp_ext <command>``."""

from .cli import main

raise SystemExit(main())
