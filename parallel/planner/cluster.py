"""The planner's description of a cluster: what one device computes and holds, and its two link classes.

Read from a conf/cluster/ preset (each figure's datasheet source is a comment there). Units in
the presets are the vendors' (GiB, TFLOP/s, GB/s, Gbit/s, microseconds); here everything is bytes,
FLOP/s, bytes per second and seconds.

A device has `peak_flops` (dense, in the training precision) of which the model's matmuls reach
`efficiency`; `memory_bytes`, of which `runtime_bytes` are taken before training starts (CUDA
context and communication buffers; the Python and torch runtime on a CPU) and `headroom` more is
kept free (allocator fragmentation, transient tensors this model does not describe).

Links: `gpus_per_node` devices share a node; inside it each device sends at `intra_bytes_per_s`
(NVLink, one direction), between nodes at `inter_bytes_per_s` (its own NIC, one direction), each
with a per-message latency. `comm_efficiency` is the share of a link's rate a collective reaches.
`shared_compute`: every rank of the job shares one peak (this CPU machine: all ranks, of all
emulated nodes, run on the same cores), so a rank computes at peak / world, and MFU divides by one
peak, as summary.json's does on a CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 2**30


class ClusterError(ValueError):
    """A cluster preset that cannot be used; the message names the field and the fix."""


@dataclass(frozen=True)
class Cluster:
    name: str
    gpus_per_node: int
    memory_bytes: float
    peak_flops: float  # per device (per machine where shared_compute)
    efficiency: float  # share of peak_flops the model's matmuls reach
    intra_bytes_per_s: float  # per device, one direction
    inter_bytes_per_s: float  # per device, one direction
    intra_latency_s: float
    inter_latency_s: float
    nodes: int | None = None  # the cluster's node count, where fixed (this machine's emulated nodes)
    hbm_bytes_per_s: float | None = None  # memory bandwidth (stated; the time model is FLOP-bound)
    comm_efficiency: float = 1.0
    runtime_bytes: float = 0.0
    headroom: float = 0.0
    precision: str = "bf16"
    algorithm: str = "hierarchical"  # how a collective over several nodes runs: hierarchical | ring
    p2p_overlap: bool = True  # pipeline sends run beside compute (NCCL streams) or on the sender's path (gloo)
    tp_backward_overlap: bool = False  # backward's column-parallel tp collectives beside their gradient GEMMs
    # (Megatron-LM's asynchronous tensor-parallel all-reduce, and sequence parallelism's reduce-scatter; timing.py)
    shared_compute: bool = False
    node_link_shared: bool = False  # a node's ranks share one link out (emulated nodes), not a NIC each
    sources: str = ""
    sms: int | None = None  # streaming multiprocessors: with hbm_bytes_per_s, the roofline per GEMM (compute.py)
    gemm_tile: tuple[int, int] = (256, 128)  # a GEMM's output tile (wave quantization)
    gemm_pipeline: tuple[int, int] | None = None  # (k-tile, stages) of that kernel, where its fill and epilogue
    # are not overlapped with the k-loop (compute.py's k0); None: overlapped (Hopper's persistent kernels)
    flash_attention: bool = True  # the attention core as one fused kernel; false: materialized scores (compute.py)
    calibration: dict | None = None  # the one fitted parameter: which, and on what (the preset's `calibration`)
    codec_bytes_per_s: float | None = None  # a rank's elementwise rate for the lossy collectives' codec (codec.py)

    def __post_init__(self):
        for name in ("gpus_per_node", "memory_bytes", "peak_flops", "efficiency", "intra_bytes_per_s",
                     "inter_bytes_per_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ClusterError(f"cluster.{name}={value!r} must be a positive number")
        if not 0 < self.efficiency <= 1 or not 0 < self.comm_efficiency <= 1:
            raise ClusterError(f"cluster.efficiency={self.efficiency} and cluster.comm_efficiency="
                               f"{self.comm_efficiency} must be fractions in (0, 1]")
        if self.algorithm not in ("hierarchical", "ring"):
            raise ClusterError(f"cluster.algorithm={self.algorithm!r}: choose hierarchical or ring")
        if self.precision not in ("fp32", "bf16"):
            raise ClusterError(f"cluster.precision={self.precision!r}: choose fp32 or bf16")

    @property
    def usable_bytes(self) -> float:
        """What training may use on one device: capacity less the runtime, less the headroom."""
        return (self.memory_bytes - self.runtime_bytes) * (1 - self.headroom)

    def flops_per_rank(self, world: int) -> float:
        """The FLOP/s one rank's matmuls reach (the peak shared by every rank where compute is shared)."""
        return self.peak_flops * self.efficiency / (world if self.shared_compute else 1)

    def device(self):
        """The roofline's view of one device (compute.py), where the preset has SMs and HBM; else None."""
        if not (self.sms and self.hbm_bytes_per_s):
            return None
        from parallel.planner.compute import Device, tile_fixed_steps

        k0 = tile_fixed_steps(self.peak_flops, self.hbm_bytes_per_s, self.sms, self.gemm_tile, *self.gemm_pipeline) \
            if self.gemm_pipeline else 0.0
        return Device(self.peak_flops, self.efficiency, self.hbm_bytes_per_s, self.sms, self.gemm_tile, k0,
                      self.flash_attention)

    def peak_for_mfu(self, world: int) -> float:
        """The denominator of MFU: one peak per device, or the one shared peak (summary.json's `devices`)."""
        return self.peak_flops * (1 if self.shared_compute else world)


def cluster_from_config(c, net=None, world: int | None = None) -> Cluster:
    """A conf/cluster/ preset (DictConfig or dict) -> Cluster. `net` (the emulated network's
    settings, conf/net/ where it exists, else the preset's own `net` block) gives this machine's
    nodes, ranks per node and link rates: inter-node links are one per node, shared by its ranks."""
    c = dict(c)
    try:
        common = dict(
            name=c["name"], peak_flops=float(c["peak_tflops"]) * 1e12 if c.get("peak_tflops") else _measured_peak(),
            efficiency=float(c["efficiency"]),
            memory_bytes=float(c["memory_gib"]) * GIB, runtime_bytes=float(c.get("runtime_gib", 0)) * GIB,
            headroom=float(c.get("headroom", 0)), precision=c.get("precision", "bf16"),
            comm_efficiency=float(c.get("comm_efficiency", 1.0)), algorithm=c.get("algorithm", "hierarchical"),
            p2p_overlap=bool(c.get("p2p_overlap", True)), shared_compute=bool(c.get("shared_compute", False)),
            tp_backward_overlap=bool(c.get("tp_backward_overlap", False)),
            hbm_bytes_per_s=float(c["hbm_tbytes_per_s"]) * 1e12 if c.get("hbm_tbytes_per_s") else None,
            sources=c.get("sources", ""), sms=int(c["sms"]) if c.get("sms") else None,
            gemm_tile=tuple(c.get("gemm_tile") or (256, 128)), calibration=c.get("calibration"),
            gemm_pipeline=tuple(c["gemm_pipeline"]) if c.get("gemm_pipeline") else None,
            flash_attention=bool(c.get("flash_attention", True)),
        )
        if not c.get("emulated"):
            # Achieved bus bandwidth (nccl-tests' busbw) where the preset gives it: theory's ring bytes per
            # rank over it is the collective's time, as nccl-tests define busbw; else the link's rate.
            intra = float(c["nvlink_busbw_gbytes_per_s"]) * 1e9 if c.get("nvlink_busbw_gbytes_per_s") \
                else float(c["nvlink_gbytes_per_s"]) / 2 * 1e9  # both directions -> one
            inter = float(c["inter_busbw_gbytes_per_s"]) * 1e9 if c.get("inter_busbw_gbytes_per_s") \
                else float(c["inter_gbit_per_s"]) / 8 * 1e9
            # The codec's passes are memory-bound kernels: HBM's rate, read and write (codec.py).
            return Cluster(gpus_per_node=int(c["gpus_per_node"]), intra_bytes_per_s=intra, inter_bytes_per_s=inter,
                           codec_bytes_per_s=common["hbm_bytes_per_s"],
                           intra_latency_s=float(c["intra_latency_us"]) * 1e-6,
                           inter_latency_s=float(c["inter_latency_us"]) * 1e-6, **common)
    except KeyError as e:
        raise ClusterError(f"cluster preset {c.get('name')!r} lacks the field {e.args[0]!r}") from None
    return _emulated(c, common, dict(net if net is not None else c["net"]), world)


def _emulated(c: dict, common: dict, net: dict, world: int | None) -> Cluster:
    """This machine's ranks on emulated nodes (the emulated network's net.* settings). Loopback (net=none, or an
    unshaped link) runs at the rate one rank reaches with this many ranks on the cores (measured by
    parallel/planner/loopback.py where the preset leaves it null); a shaped link at its rate. A node
    has one link to the others, shared by the transfers that leave the node at once."""
    nodes = int(net.get("nodes") or 1)
    per_node = int(net.get("procs_per_node") or 0) or (world // nodes if world else 1)
    if net.get("name") == "none" and world:
        per_node = world  # no emulation: every rank on this machine, whatever launch.run's default is
    if world and nodes * per_node != world:
        raise ClusterError(f"plan.world={world} but the network has net.nodes x net.procs_per_node = {nodes} x "
                           f"{per_node} = {nodes * per_node} ranks: set plan.world={nodes * per_node}")
    c = _with_measured_figures(c, world or per_node * nodes)
    loopback = float(c["loopback_gbytes_per_s"]) * 1e9  # per rank, with this many ranks on the cores
    inter_mbit, intra_mbit = net.get("inter_mbit"), net.get("intra_mbit")
    latency = float(net.get("latency_ms") or 0) * 1e-3
    if world:
        common["memory_bytes"] /= world  # every rank of every emulated node shares the machine's memory
    codec = float(c["codec_gbytes_per_s"]) * 1e9
    return Cluster(gpus_per_node=per_node, nodes=nodes, node_link_shared=True, codec_bytes_per_s=codec,
                   intra_bytes_per_s=intra_mbit * 1e6 / 8 / per_node if intra_mbit else loopback,
                   inter_bytes_per_s=inter_mbit * 1e6 / 8 if inter_mbit and nodes > 1 else loopback,
                   intra_latency_s=float(c["loopback_latency_us"]) * 1e-6,
                   inter_latency_s=float(c["loopback_latency_us"]) * 1e-6 + latency, **common)


def _with_measured_figures(c: dict, ranks: int) -> dict:
    """The preset with its null loopback and codec figures measured with `ranks` gloo ranks on this
    machine's cores (parallel/planner/loopback.py), in one probe run; a one-rank plan's codec (its
    optimizer step) in this process, with the threads a lone rank has, and no probe run for it."""
    missing = [k for k in ("loopback_gbytes_per_s", "loopback_latency_us", "codec_gbytes_per_s") if c.get(k) is None]
    figures = {}
    if ranks <= 1 and "codec_gbytes_per_s" in missing:
        from parallel.dist.binding import threads_per_rank
        from parallel.planner.codec import probed_bytes_per_s

        figures["codec_gbytes_per_s"] = probed_bytes_per_s(threads_per_rank(1)) / 1e9
    if any(k not in figures for k in missing):
        from parallel.planner.loopback import measure

        measured = measure(ranks)
        figures = {"loopback_gbytes_per_s": measured["bytes_per_s"] / 1e9,
                   "loopback_latency_us": measured["latency_s"] * 1e6,
                   "codec_gbytes_per_s": measured["codec_bytes_per_s"] / 1e9, **figures}
    return {**c, **{k: figures[k] for k in missing}}


def _measured_peak() -> float:
    """This machine's peak FLOP/s, measured as every run measures it (parallel/report/mfu.py)."""
    import torch

    from parallel.report.mfu import measure_peak_flops

    return measure_peak_flops(torch.device("cpu"))
