"""Test/demo helpers: a tiny real Megatron-Core GPTModel trained on the CPU with gloo, in several
processes, under Megatron's own schedules or any ``forward_backward_func``.

* ``cpu_shims``  -- what Megatron's model code and schedules need to run without a GPU.
* ``launch``     -- ``spawn(world_size, fn, ...)`` and ``init_megatron(pp, vp)``.
* ``tiny_gpt``   -- the model, its pipeline split (loop and V layouts), data, forward step.
* ``reference``  -- ``run_step`` (a spawn target: one step under a schedule), merge/compare.

Nothing here is imported by the plugin's own code path.
"""
