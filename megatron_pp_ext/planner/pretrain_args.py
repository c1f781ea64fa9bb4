"""Reading a ``pretrain_gpt.py`` command line as Megatron-LM does, without a GPU: the launcher
in front of it (the world size), Megatron's own parser (``megatron.training.arguments.parse_args``
with the plugin's group, as ``scripts/pretrain_gpt_pp.py`` parses them, so a flag Megatron does
not know is refused as it would be), and the sizes Megatron's ``validate_args`` derives (it is
not run: it asks the GPU for its architecture and the job's environment):

* p = ``--pipeline-model-parallel-size``; dp = world size / (tp x pp x cp), the world size from
  ``--world-size``, else from a launcher in front of the script (``torchrun --nnodes N
  --nproc-per-node G ... pretrain_gpt.py``: N x G; ``srun --ntasks N`` or ``--nodes N
  --ntasks-per-node G``), else dp = 1 (said so);
* m = global batch / (micro batch x dp) (global batch default: micro batch x dp, m = 1).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import sys
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any, Sequence

from ..integration.megatron_args import add_pipeline_schedule_args
from ..integration.megatron_import import import_megatron


def split_launcher(argv: Sequence[str]) -> tuple[list[str], int | None, str | None]:
    """``(pretrain arguments, world size, where it came from)`` from a command line that may
    start with a launcher and a script (``torchrun --nnodes 8 --nproc-per-node 8
    pretrain_gpt.py --num-layers ...``): what follows the first ``*.py`` is the script's; the
    world size is the launcher's nodes x processes per node (torchrun, srun), or None."""
    argv = [str(a) for a in argv]
    if argv and argv[0] == "--":
        argv = argv[1:]
    script = next((i for i, a in enumerate(argv) if a.endswith(".py") and not a.startswith("-")),
                  None)
    if script is None:
        return argv, None, None
    before, after = argv[:script], argv[script + 1:]
    if not before:
        return after, None, None
    nnodes = _flag(before, "--nnodes", "--nodes", "-N")
    per_node = _flag(before, "--nproc-per-node", "--nproc_per_node", "--ntasks-per-node")
    tasks = _flag(before, "--ntasks", "-n")
    launcher = " ".join(before)
    if tasks is not None:
        return after, _count(tasks, "--ntasks", launcher), f"the launcher's --ntasks {tasks}"
    if per_node is None:
        return after, None, None
    nodes = _count(nnodes or "1", "--nnodes", launcher)
    gpus = _count(per_node, "--nproc-per-node", launcher)
    return after, nodes * gpus, (f"the launcher: {nodes} node(s) x {gpus} process(es) per "
                                 "node")


def _flag(tokens: list[str], *names: str) -> str | None:
    for i, token in enumerate(tokens):
        for name in names:
            if token == name and i + 1 < len(tokens):
                return tokens[i + 1]
            if token.startswith(name + "="):
                return token.split("=", 1)[1]
    return None


def _count(text: str, flag: str, launcher: str) -> int:
    low, _, high = text.partition(":")
    if (high and high != low) or not low.isdigit():
        raise ValueError(f"cannot tell the world size from {flag} {text} in '{launcher}': "
                         "give plan --world-size N")
    return int(low)


def _megatron_parse_args():
    """Megatron-LM's ``parse_args`` with the plugin's argument group, imported quietly. Its
    parser is built once: Megatron builds it anew on every call, reading its config
    dataclasses' source for the help texts (0.14 s of a plan's 0.17 s), and ``select
    --search-parallelism`` parses hundreds of command lines."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # importing Megatron (and torch) on a machine without CUDA logs about it: not ours to say
        logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
        with contextlib.redirect_stderr(io.StringIO()):
            # without a GPU, not compiling Megatron's fusions: 2.8 s of CPU (no model runs here)
            import_megatron("megatron.training.arguments")
    module = sys.modules["megatron.training.arguments"]
    build = module.add_megatron_arguments  # 0.17 to main: parse_args builds its parser with it

    def parse_args():
        with _BUILDING:  # the module's function is swapped for the call: one caller at a time
            if "parser" not in _BUILT:
                fresh = argparse.ArgumentParser(description="Megatron-LM Arguments",
                                                allow_abbrev=False)
                _BUILT["parser"] = add_pipeline_schedule_args(build(fresh))
            module.add_megatron_arguments = lambda parser: _BUILT["parser"]
            try:
                return module.parse_args()
            finally:
                module.add_megatron_arguments = build
    return parse_args


#: Megatron's parser with the plugin's arguments, once built (``_megatron_parse_args``)
_BUILT: dict = {}
_BUILDING = threading.Lock()


def _megatron_logs_to_stderr() -> None:
    """Point Megatron-LM's log handler at stderr: importing ``megatron.training`` puts one on
    the root logger that writes to stdout (``log_handler.CustomHandler``), and the layout
    parser logs through it; the planner's stdout is its report, or its JSON."""
    for handler in logging.getLogger().handlers:
        if (isinstance(handler, logging.StreamHandler)
                and handler.stream in (sys.stdout, sys.__stdout__)):
            handler.setStream(sys.stderr)


def parse_pretrain_args(argv: Sequence[str]):
    """Megatron-LM's own parser (``megatron.training.arguments.parse_args``, with the plugin's
    argument group) over ``argv``, as ``pretrain_gpt.py`` would parse it. Nothing is validated
    or initialized; Megatron's import warnings are kept quiet. ValueError when Megatron's
    parser refuses the arguments (its message)."""
    saved, errors = sys.argv, io.StringIO()
    parse_args = _megatron_parse_args()
    _megatron_logs_to_stderr()  # the planner's stdout is its report or its JSON
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sys.argv = ["pretrain_gpt.py", *argv]
        try:
            with contextlib.redirect_stderr(errors):
                return parse_args()
        except SystemExit:
            lines = [line for line in errors.getvalue().splitlines() if line.strip()]
            said = lines[-1] if lines else "it exited"
            raise ValueError(f"Megatron-LM's parser refuses the arguments: {said}") from None
        finally:
            sys.argv = saved


def required_arg(args: Any, name: str, flag: str) -> int:
    value = getattr(args, name, None)
    if name == "seq_length" and value is None:
        value = getattr(args, "encoder_seq_length", None)
    if value is None:
        raise ValueError(f"the arguments have no {flag}: the plan needs it")
    return int(value)



@dataclass
class Sizes:
    """The parallel sizes and the batch of one step, as Megatron derives them."""

    tp: int
    pp: int
    cp: int
    dp: int
    world_size: int
    world_from: str  # where the world size came from
    micro_batch: int
    global_batch: int
    num_microbatches: int  # m
    notes: list[str] = field(default_factory=list)


def derive_sizes(args: Any, world_size: int | None, launched: int | None,
                 launched_from: str | None) -> Sizes:
    """tp, pp, cp, dp and m from Megatron's arguments and the world size (``--world-size``,
    else the launcher's, else tp x pp x cp); ValueError naming the values and the fix."""
    tp = int(args.tensor_model_parallel_size or 1)
    pp = int(args.pipeline_model_parallel_size or 1)
    cp = int(getattr(args, "context_parallel_size", 1) or 1)
    model_parallel = tp * pp * cp
    if world_size is not None:
        world, world_from = int(world_size), "--world-size"
        if launched is not None and launched != world:
            raise ValueError(f"--world-size {world} disagrees with {launched_from} "
                             f"(= {launched}): drop one")
    elif launched is not None:
        world, world_from = launched, launched_from
    else:
        world, world_from = model_parallel, "assumed: no --world-size and no launcher, so dp = 1"
    if world < 1 or world % model_parallel:
        raise ValueError(
            f"world size {world} ({world_from}) is not a multiple of tp x pp x cp = {tp} x {pp} "
            f"x {cp} = {model_parallel}: give a world size that is (e.g. "
            f"--world-size {model_parallel * max(1, world // model_parallel)}), or change "
            "--tensor-model-parallel-size / --pipeline-model-parallel-size / "
            "--context-parallel-size")
    sizes = Sizes(tp, pp, cp, world // model_parallel, world, world_from, 0, 0, 0)
    _derive_batch(args, sizes)
    return sizes


def _derive_batch(args: Any, sizes: Sizes) -> None:
    micro, dp = getattr(args, "micro_batch_size", None), sizes.dp
    if micro is None:
        raise ValueError("the arguments have no --micro-batch-size: Megatron needs it (and the "
                         "plan, for m and the activation estimate)")
    micro = int(micro)
    global_batch = args.global_batch_size
    if global_batch is None:
        global_batch = micro * dp
        sizes.notes.append(f"no --global-batch-size: Megatron uses micro batch x dp = "
                           f"{global_batch}")
    global_batch = int(global_batch)
    if global_batch % (micro * dp):
        step = micro * dp
        lower, upper = (global_batch // step) * step, (global_batch // step + 1) * step
        raise ValueError(
            f"--global-batch-size {global_batch} is not a multiple of --micro-batch-size "
            f"{micro} x dp {dp} = {step} (dp = world {sizes.world_size} / (tp {sizes.tp} x pp "
            f"{sizes.pp} x cp {sizes.cp})): use --global-batch-size {upper}"
            f"{f' or {lower}' if lower else ''}, or change --micro-batch-size or the world size")
    sizes.micro_batch, sizes.global_batch = micro, global_batch
    sizes.num_microbatches = global_batch // (micro * dp)


__all__ = ["Sizes", "derive_sizes", "parse_pretrain_args", "required_arg", "split_launcher"]
