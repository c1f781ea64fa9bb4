"""The machines a step is priced on: GPUs per node, the NVLink and scale-out bandwidth each GPU
has, and its memory bandwidth, from NVIDIA's data sheets. It imports nothing of the package but
``gpus``: the commands read it to list their choices without loading Megatron.

A machine is a preset (``DGX-H100``, ``DGX-H200``, ``DGX-B200``) or the user's own, written
``GPU:GPUS_PER_NODE:NVLINK_GBPS:NETWORK_GBPS`` (per GPU, one direction, GB/s), e.g.
``H100:8:450:25`` for a node with one 200 Gb/s NIC per GPU."""

from __future__ import annotations

from dataclasses import dataclass

from .gpus import GPUS, Gpu, gpu_named

GB = 1e9


@dataclass(frozen=True)
class Machine:
    name: str
    gpu: Gpu
    gpus_per_node: int
    nvlink_bytes_per_s: float  # per GPU, one direction, to the other GPUs of its node
    network_bytes_per_s: float  # per GPU, one direction, to other nodes (its NIC)
    hbm_bytes_per_s: float  # the GPU's memory bandwidth
    source: str

    def link_bytes_per_s(self, group_span: int) -> float:
        """The bandwidth one GPU of a ring over ``group_span`` consecutive-node GPUs has: NVLink
        when the group fits in a node, else its NIC (a ring crossing nodes runs at the slowest
        hop)."""
        return self.nvlink_bytes_per_s if group_span <= self.gpus_per_node else (
            self.network_bytes_per_s)

    def ring_bytes_per_s(self, group: int, stride: int) -> float:
        """The bandwidth of a ring over ``group`` ranks ``stride`` apart: NVLink's inside a
        node, else the NIC's times the group's ranks per node (NCCL's rings spread over the
        node's NICs), at most NVLink's."""
        if group * stride <= self.gpus_per_node:
            return self.nvlink_bytes_per_s
        per_node = max(1, self.gpus_per_node // stride)
        return min(self.nvlink_bytes_per_s, per_node * self.network_bytes_per_s)


#: HBM bandwidths from the same data sheets as gpus.GPUS.
_HBM = {"H100": 3.35e12, "H200": 4.8e12, "B200": 8.0e12}

PRESETS = {
    "DGX-H100": Machine("DGX-H100", GPUS["H100"], 8, 450 * GB, 50 * GB, _HBM["H100"],
                        "NVIDIA DGX H100 data sheet: 8 H100 SXM, NVLink 4 at 900 GB/s per GPU "
                        "(450 each way), 8 ConnectX-7 400 Gb/s (one per GPU, 50 GB/s), HBM3 "
                        "3.35 TB/s"),
    "DGX-H200": Machine("DGX-H200", GPUS["H200"], 8, 450 * GB, 50 * GB, _HBM["H200"],
                        "NVIDIA DGX H200 data sheet: 8 H200 SXM, NVLink 4 at 900 GB/s per GPU, "
                        "8 ConnectX-7 400 Gb/s, HBM3e 4.8 TB/s"),
    "DGX-B200": Machine("DGX-B200", GPUS["B200"], 8, 900 * GB, 50 * GB, _HBM["B200"],
                        "NVIDIA DGX B200 data sheet: 8 B200, NVLink 5 at 1.8 TB/s per GPU (900 "
                        "each way), 8 ConnectX-7 400 Gb/s (one per GPU, 50 GB/s), HBM3e 8 TB/s"),
}
#: The machine a GPU kind is priced on when only ``--gpu`` is given.
DEFAULT_FOR_GPU = {"H100": "DGX-H100", "H200": "DGX-H200", "B200": "DGX-B200"}


def machine_named(text: str | None, gpu: str | None = None) -> Machine:
    """A preset by name, a ``GPU:GPUS_PER_NODE:NVLINK_GBPS:NETWORK_GBPS`` spec, or (``text``
    None) the preset of ``gpu``."""
    if text is None:
        if gpu is None:
            raise ValueError("give --gpu NAME or --machine NAME to price a step")
        return PRESETS[DEFAULT_FOR_GPU[gpu_named(gpu).name]]
    machine = _machine(text)
    if gpu is not None and gpu_named(gpu).name != machine.gpu.name:
        raise ValueError(f"--gpu {gpu} and --machine {text} ({machine.gpu.name}) disagree: "
                         "give one of them")
    return machine


def _machine(text: str) -> Machine:
    key = text.upper()
    if key in PRESETS:
        return PRESETS[key]
    parts = text.split(":")
    if len(parts) != 4:
        raise ValueError(f"--machine {text}: name a preset ({', '.join(PRESETS)}) or write "
                         "GPU:GPUS_PER_NODE:NVLINK_GBPS:NETWORK_GBPS, e.g. H100:8:450:25")
    device = gpu_named(parts[0])
    try:
        per_node, nvlink, network = int(parts[1]), float(parts[2]), float(parts[3])
    except ValueError:
        raise ValueError(f"--machine {text}: GPUS_PER_NODE is a whole number, NVLINK_GBPS and "
                         "NETWORK_GBPS are GB/s per GPU, one direction (e.g. H100:8:450:25)")
    if per_node < 1 or nvlink <= 0 or network <= 0:
        raise ValueError(f"--machine {text}: GPUs per node >= 1 and both bandwidths > 0")
    return Machine(text, device, per_node, nvlink * GB, network * GB, _HBM[device.name],
                   f"given: {per_node} {device.name} per node, NVLink {nvlink:g} GB/s, network "
                   f"{network:g} GB/s per GPU")


__all__ = ["DEFAULT_FOR_GPU", "Machine", "PRESETS", "machine_named"]
