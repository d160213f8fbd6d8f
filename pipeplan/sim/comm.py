"""Collective and point-to-point times by placement: which link each group of ranks talks over.

Ranks are laid out as Megatron does: tensor-parallel innermost, then pipeline, then data parallel, so global
rank = tp_rank + t * (pp_rank + p * dp_rank), and node = rank // gpus_per_node. A group whose members share a
node talks over NVLink (intra-node figures), one spanning nodes over the NICs (inter-node figures, one NIC per
GPU as on DGX nodes, so the per-GPU bandwidth applies to a ring through them).

Ring collectives over n ranks (Patarasuk & Yuan 2009; NCCL's ring algorithm, NCCL docs "Collective
Operations"): all-reduce moves 2(n-1)/n of the buffer per rank in 2(n-1) steps; reduce-scatter and
all-gather (n-1)/n in n-1 steps. Each step pays the link latency.

Bandwidth is what NCCL sustains, not the line rate: a preset's link bandwidth is its datasheet figure times
the device's `nvlink_efficiency` / `nic_efficiency`, the large-message nccl-tests bus bandwidth over the line
rate (sim/devices.toml gives the sources). nccl-tests' busbw already applies the ring factors above, so the
efficiency scales the link and the ring formulas stay as they are. A scenario's interconnect.*_gbps are taken
as given (absolute effective figures, no efficiency applied).
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeplan.sim.config import Scenario


@dataclass(frozen=True)
class Link:
    bytes_per_s: float
    latency_s: float

    def transfer_s(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bytes_per_s


@dataclass(frozen=True)
class Links:
    intra: Link
    inter: Link
    gpus_per_node: int

    def for_ranks(self, ranks: list[int]) -> Link:
        """The link a group uses: intra-node if every member sits in one node."""
        nodes = {r // self.gpus_per_node for r in ranks}
        return self.intra if len(nodes) <= 1 else self.inter


def build_links(sc: Scenario, dev: dict[str, float]) -> Links:
    net = sc.interconnect
    nvlink = dev["nvlink_gbps"] * dev.get("nvlink_efficiency", 1.0)
    nic = dev["nic_gbps"] * dev.get("nic_efficiency", 1.0)
    intra_bw = net.intra_node_gbps if net.intra_node_gbps is not None else nvlink
    inter_bw = net.inter_node_gbps if net.inter_node_gbps is not None else nic
    intra_lat = net.intra_node_latency_us if net.intra_node_latency_us is not None else dev["nvlink_latency_us"]
    inter_lat = net.inter_node_latency_us if net.inter_node_latency_us is not None else dev["nic_latency_us"]
    return Links(Link(intra_bw * 1e9, intra_lat * 1e-6), Link(inter_bw * 1e9, inter_lat * 1e-6),
                 sc.parallel.gpus_per_node)


def all_reduce_s(nbytes: float, n: int, link: Link) -> float:
    if n <= 1 or nbytes <= 0:
        return 0.0
    return 2 * (n - 1) * link.latency_s + 2 * (n - 1) / n * nbytes / link.bytes_per_s


def all_gather_s(nbytes: float, n: int, link: Link) -> float:
    """All-gather (or reduce-scatter) of a buffer of `nbytes` in total (each rank holds nbytes / n)."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return (n - 1) * link.latency_s + (n - 1) / n * nbytes / link.bytes_per_s


reduce_scatter_s = all_gather_s


def global_rank(sc: Scenario, tp_rank: int, pp_rank: int, dp_rank: int) -> int:
    t, p = sc.parallel.tp, sc.pipeline.stages
    return tp_rank + t * (pp_rank + p * dp_rank)


def tp_link(sc: Scenario, links: Links) -> Link:
    link = links.for_ranks([global_rank(sc, i, 0, 0) for i in range(sc.parallel.tp)])
    bw = sc.interconnect.tp_gbps
    return Link(bw * 1e9, link.latency_s) if bw is not None else link


def dp_link(sc: Scenario, links: Links) -> Link:
    return links.for_ranks([global_rank(sc, 0, 0, d) for d in range(sc.parallel.dp)])


def p2p_link(sc: Scenario, links: Links) -> Link:
    """The slowest link between pipeline neighbours (chunk boundaries, incl. the wrap of interleaving)."""
    p, net = sc.pipeline.stages, sc.interconnect
    pairs = [(r, r + 1) for r in range(p - 1)]
    if sc.pipeline.virtual_stages > 1 and p > 1:
        pairs.append((p - 1, 0))
    links_used = [links.for_ranks([global_rank(sc, 0, a, 0), global_rank(sc, 0, b, 0)]) for a, b in pairs]
    link = min(links_used, key=lambda k: k.bytes_per_s) if links_used else links.intra
    bw = net.p2p_gbps * 1e9 if net.p2p_gbps is not None else link.bytes_per_s
    lat = net.p2p_latency_us * 1e-6 if net.p2p_latency_us is not None else link.latency_s
    return Link(bw, lat)
