"""The planner: what a Megatron-LM command line would hold and do on every pipeline rank,
without a GPU (``plan``, ``select``, ``compare`` and ``simulate -- ARGS``). It reads the
arguments with Megatron-LM's own parser, splits the model as Megatron and the drop-in split it
(``integration.stage_layers``, shared with the drop-in), prices each stage from its FLOPs and
counts each rank's bytes. A program of its own beside ``integration/``, the drop-in, whose
modules it uses and which never imports it (``tests/test_layers.py``)."""
