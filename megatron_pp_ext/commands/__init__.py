"""CLI subcommands, one module each (listed in ``megatron_pp_ext.cli.COMMANDS``).

A command module has ``register(subparsers)``, which adds its parser and sets
``func=run``, and ``run(args) -> int`` (the exit status). Raise ``ValueError`` (or
``ScheduleError``) or ``OSError`` for bad input: the CLI prints it as one ``error:`` line and
exits 2.
"""
