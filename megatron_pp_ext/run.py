"""Run an unmodified training script with the schedule named by $MEGATRON_PP_SCHEDULE:

    MEGATRON_PP_SCHEDULE=zb-h1 torchrun ... -m megatron_pp_ext.run pretrain_gpt.py <its args>
"""

from __future__ import annotations

import runpy
import sys


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit("usage: python -m megatron_pp_ext.run SCRIPT.py [ARGS...]")
    from megatron_pp_ext.integration.install import install_from_env

    # Megatron's modules must be loaded for install() to find every bound name.
    import megatron.core.pipeline_parallel.schedules  # noqa: F401

    install_from_env()
    script, sys.argv = sys.argv[1], sys.argv[1:]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
