"""``verify``: the user's own ``pretrain_gpt.py`` job run twice, under Megatron's own schedule and
under a chosen one, from the same start, compared step by step, timed and measured.

Layers (each module one job):

* ``runs``: the two runs' command lines from the job's, and every refusal before anything
  starts (``ValueError``: the value, the rule, the fix);
* ``rank``: one rank of one run: Megatron-LM's ``pretrain_gpt.py`` through
  ``integration.pretrain_gpt_script``, recorded by ``recorder`` (per step: losses, grad norm,
  every parameter's gradient norm (``param_grads``), step time, peak memory; the measured
  timeline: the plugin's trace, or ``megatron_trace`` for Megatron's own schedule);
* ``launch``: the runs one after the other, as local gloo processes (no launcher) or, under
  torchrun / srun, as a child process of each rank;
* ``compare``: the verdict (IDENTICAL, WITHIN TOLERANCE, DIFFERENT, or the run's failure);
* ``report``: the screen, ``verify.json``, ``verify.html``, the costs files.
"""
