"""launch.compare on emulated networks: which networks a sweep runs on, the world of each run, the
network columns of a row, and per network the best layout and what the others wait on.

    python -m launch.compare net=cluster                                   # every strategy on one network
    python -m launch.compare 'compare.nets=[none,ethernet_1g,cluster]'     # once per network, and the crossover

A network is a preset of conf/net/ (`cluster`), or in `compare.nets` a preset with fields changed,
written as a Hydra dict: `{preset:cluster,inter_mbit:200}` (its label: `cluster(inter_mbit=200)`,
or the entry's own `label:`).

The world of a run. On `none` nothing changes: compare.world, with compare.worlds' exceptions
(single 1, 3d 8), each run `torchrun --standalone`. On an emulated network every strategy runs
through `launch.run` on the network's nodes x procs_per_node processes, except those whose world
is 1 (`single`: one process, no links; the reference), which run as one plain process. So the
world is derived from the network: a `compare.world=` or `compare.worlds.<name>=` given on the
command line that does not match it is refused in one line, before anything runs (the defaults,
like 3d's 8, are net=none's and give way to the network's world). A `none` entry of compare.nets
may carry its own world as `{preset:none,procs_per_node:2}`.

Per network (`network_verdict`): the fastest strategy, and for each other what it waits on, from
its time breakdown (compute, exposed communication, bubble) and the `net` block: how long the
busiest link of each class must carry that class's bytes a step at its rate (max over nodes of
the bytes it sent or received, x 8 / rate). Exposed communication is put down to a link that is
busy at least half as long (LINK_BOUND); where every link is busy for less, to the ranks waiting
for one another (compute skew, the shared CPU).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import OmegaConf

from parallel.compare.rows import NET_COLUMNS
from parallel.compare.verdict import main_wait
from parallel.net.topology import NetConfigError, NetSpec

LINK_BOUND = 0.5  # exposed communication is put down to a link that is busy at least this share of it


class NetworkRefused(ValueError):
    """A sweep that cannot run on the networks asked for; the message is the one line to print."""


def _number(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def load_preset(config_dir: str, name) -> dict:
    path = Path(config_dir) / "net" / f"{name}.yaml"
    if not isinstance(name, str) or not path.exists():
        presets = ", ".join(sorted(p.stem for p in path.parent.glob("*.yaml")))
        raise NetworkRefused(f"net preset {name!r}: no conf/net/{name}.yaml (presets: {presets})")
    return OmegaConf.to_container(OmegaConf.load(path), resolve=True)


@dataclass(frozen=True)
class Network:
    """One network of a sweep: its settings, its label in the results, and its world."""

    label: str
    spec: NetSpec
    world: int                                  # the world of its runs (none: compare.world, or the entry's)
    changed: dict = field(default_factory=dict)  # the fields that differ from the preset

    @property
    def emulated(self) -> bool:
        return self.spec.emulated

    @property
    def dir_name(self) -> str:
        """A directory name for the network's sweep (`cluster(inter_mbit=200)` -> cluster-inter_mbit-200)."""
        return re.sub(r"[^A-Za-z0-9_.]+", "-", self.label).strip("-")

    def launch_overrides(self) -> list[str]:
        """launch.run's: the preset, then every field as run (so that changed ones reach the run)."""
        values = self.spec.as_dict()
        return [f"net={values.pop('name')}"] + [f"net.{k}={'null' if v is None else _number(v)}"
                                                for k, v in values.items()]

    def describe(self) -> str:
        """`2 nodes x 2 ranks, 200 Mbit/s between nodes, 10000 Mbit/s inside, cyclic placement`."""
        s = self.spec
        if not self.emulated:
            return f"this machine's loopback, unshaped, world {self.world}"
        text = f"{s.nodes} nodes x {s.procs_per_node} rank{'s' if s.procs_per_node > 1 else ''}, "
        text += f"{_number(s.inter_mbit)} Mbit/s between nodes" if s.inter_mbit else "unshaped between nodes"
        if s.procs_per_node > 1:
            text += f", {_number(s.intra_mbit)} Mbit/s inside" if s.intra_mbit else ", unshaped inside"
        if s.loss_pct:
            text += f", {s.loss_pct:g}% loss"
        if s.placement != "block":
            text += f", {s.placement} placement"
        return text


def network_of(values: dict, preset: dict, label: str | None, compare_world: int, own_world: bool) -> Network:
    """A Network from its merged field values. `own_world`: a none entry that sets its procs_per_node."""
    try:
        spec = NetSpec.from_config(values)
    except NetConfigError as e:
        raise NetworkRefused(str(e)) from None
    changed = {k: v for k, v in values.items() if k != "name" and preset.get(k) != v}
    if label is None:
        label = spec.name + (f"({', '.join(f'{k}={_number(v)}' for k, v in changed.items())})" if changed else "")
    world = spec.world_size if spec.emulated or own_world else compare_world
    return Network(label, spec, world, changed)


def from_group(config_dir: str, net_cfg, compare_world: int) -> Network:
    """The network of `net=<preset>` (and any `net.*` overrides): the one-network sweep."""
    values = OmegaConf.to_container(net_cfg, resolve=True)
    return network_of(values, load_preset(config_dir, values.get("name")), None, compare_world, own_world=False)


def from_entry(config_dir: str, entry, compare_world: int) -> Network:
    """One element of compare.nets: a preset name, or {preset: name, <field>: value, ..., label: text}."""
    if isinstance(entry, str):
        return network_of(load_preset(config_dir, entry), load_preset(config_dir, entry), None, compare_world, False)
    entry = dict(entry)
    if "preset" not in entry:
        raise NetworkRefused(f"compare.nets element {entry}: name its preset, e.g. {{preset:cluster,inter_mbit:200}}")
    name, label = entry.pop("preset"), entry.pop("label", None)
    preset = load_preset(config_dir, name)
    fields = [k for k in preset if k != "name"]
    unknown = sorted(set(entry) - set(fields))
    if unknown:
        raise NetworkRefused(f"compare.nets element {{preset:{name},...}}: no net field {', '.join(unknown)} "
                             f"(fields: {', '.join(fields)}; and label)")
    own_world = preset["name"] == "none" and "procs_per_node" in entry
    return network_of({**preset, **entry}, preset, None if label is None else str(label), compare_world, own_world)


def explicit_keys(task_overrides: list[str]) -> tuple[bool, set[str], bool]:
    """From the command line's overrides: whether compare.world was given, which compare.worlds.<name>
    were (`*`: the whole dict), and whether any net=/net.* was."""
    world, worlds, net = False, set(), False
    for override in task_overrides:
        key = override.lstrip("+~").partition("=")[0]
        world |= key == "compare.world"
        if key == "compare.worlds":
            worlds.add("*")
        elif key.startswith("compare.worlds."):
            worlds.add(key[len("compare.worlds."):])
        net |= key == "net" or key.startswith("net.")
    return world, worlds, net


def strategy_world(strategy: str, compare, network: Network) -> int:
    """The world `strategy` runs at on `network` (see the module docstring)."""
    given = compare.worlds.get(strategy)
    if not network.emulated:
        return int(given if given is not None else network.world)
    return 1 if given == 1 else network.world


def check_worlds(networks: list[Network], compare, strategies: list[str], explicit_world: bool,
                 explicit_worlds: set[str]) -> None:
    """Refuse a world given on the command line that an emulated network cannot run."""
    for net in (n for n in networks if n.emulated):
        fits = f"net={net.label} runs {net.spec.nodes} nodes x {net.spec.procs_per_node} = {net.world} processes"
        if explicit_world and compare.world != net.world:
            raise NetworkRefused(f"compare.world={compare.world} does not match the network: {fits}, and on an "
                                 "emulated network every run has its world; leave compare.world out (it is derived) "
                                 "or change net.nodes / net.procs_per_node")
        for name in strategies:
            given = compare.worlds.get(name)
            if (name in explicit_worlds or "*" in explicit_worlds) and given not in (None, 1, net.world):
                raise NetworkRefused(f"compare.worlds.{name}={given} does not match the network: {fits}; on an "
                                     f"emulated network a strategy runs at its world (or at 1, without links)")


def net_columns(network: Network, summary: dict | None) -> dict:
    """The row's network columns: the network's settings, and the `net` block's bytes per link class
    (None for a run without one: net=none, or one process)."""
    s = network.spec
    row = dict.fromkeys(NET_COLUMNS)
    row.update(network=network.label, nodes=s.nodes, procs_per_node=s.procs_per_node if s.emulated else network.world,
               placement=s.placement, inter_mbit=s.inter_mbit, intra_mbit=s.intra_mbit)
    net = (summary or {}).get("net")
    if not net or net.get("wire_inter_bytes_per_step") is None:
        return row
    for kind in ("inter", "intra"):
        row[f"{kind}_wire_bytes_per_step"] = net[f"wire_{kind}_bytes_per_step"]
        row[f"{kind}_logged_bytes_per_step"] = net[f"logged_{kind}_bytes_per_step"]
        row[f"{kind}_link_busy_ms"] = link_busy_ms(net, kind)
    return row


def link_busy_ms(net: dict, kind: str) -> float | None:
    """How long the busiest link of `kind` must carry its bytes a step at its rate: the largest of any
    node's sent or received bytes per timed step, x 8 / rate. None where that class is unshaped."""
    mbit = net["settings"].get(f"{kind}_mbit")
    if not mbit or not net.get("timed_steps"):
        return None
    busiest = max(max(node[kind]["tx_bytes"], node[kind]["rx_bytes"]) for node in net["wire_by_node"].values())
    return busiest / net["timed_steps"] * 8 / (mbit * 1e6) * 1e3


def waits_on(row: dict, summary: dict | None) -> str:
    """What one row waits on, in a few words with its numbers."""
    if row.get("compute_ms") is None:
        return "-"
    wait = main_wait(row, summary)
    if wait is None:
        if row.get("exposed_comm_share") is None:
            return "inside PyTorch, out of the log's sight (counted as compute)"
        return f"mostly computes ({row['compute_ms'] / row['step_ms']:.0%} of its step)"
    name, share, detail = wait
    if name == "bubble":
        return f"the pipeline bubble: {row['bubble_ms']:.0f} ms ({share:.0%} of its step)"
    exposed = row["exposed_comm_ms"]
    what = f"communication{f' ({detail})' if detail else ''}: {exposed:.0f} ms exposed ({share:.0%})"
    links = {kind: row.get(f"{kind}_link_busy_ms") for kind in ("inter", "intra")}
    links = {kind: ms for kind, ms in links.items() if ms is not None}
    if not links:
        return what
    kind = max(links, key=links.get)
    if links[kind] >= LINK_BOUND * exposed:
        return f"{what}: the {kind}-node link, busy {links[kind]:.0f} ms a step"
    return f"{what}: links busy at most {links[kind]:.0f} ms, so mostly waiting on other ranks"


def best_layout(ok: list[dict]) -> dict:
    """The fastest layout over ranks: a one-process run (`single`, the loss reference) touches no
    link, so on 2 CPU cores it can outrun every layout of 4 ranks without saying anything about
    the network; it is the best only when nothing else ran."""
    spread = [r for r in ok if (r.get("world") or 1) > 1]
    return max(spread or ok, key=lambda r: r["tokens_per_s"])


def verdict_cell(row: dict, best: dict, summaries: dict[str, dict]) -> str:
    if row is best:
        return "fastest"
    if (row.get("world") or 1) == 1:
        return "one process, no links (the reference)"
    return waits_on(row, summaries.get(row["strategy"]))


def network_verdict(network: Network, rows: list[dict], summaries: dict[str, dict]) -> list[str]:
    """Markdown: the network in words, the best layout, and a table of what each strategy waits on."""
    ok = sorted((r for r in rows if r["status"] == "ok" and r.get("tokens_per_s")), key=lambda r: -r["tokens_per_s"])
    head = f"**{network.label}** ({network.describe()})"
    if not ok:
        return [f"{head}: no strategy ran.", ""]
    best = best_layout(ok)
    lines = [f"{head}: the best layout is **{best['strategy']}** ({best['layout']}) at {best['tokens_per_s']:.0f} "
             f"tokens/s, {best['step_ms']:.0f} ms per step.", "",
             "| strategy | tokens/s | step ms | compute | exposed comm | bubble | inter MB/step | inter link busy ms "
             "| intra MB/step | intra link busy ms | waits on |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]

    def cell(value, fmt="{:.0f}", scale=1.0):
        return "-" if value is None else fmt.format(value * scale)

    for r in ok:
        lines.append(f"| {r['strategy']} | {cell(r['tokens_per_s'])} | {cell(r['step_ms'])} | {cell(r['compute_ms'])} "
                     f"| {cell(r['exposed_comm_ms'])} | {cell(r['bubble_ms'])} "
                     f"| {cell(r['inter_wire_bytes_per_step'], '{:.2f}', 1e-6)} | {cell(r['inter_link_busy_ms'])} "
                     f"| {cell(r['intra_wire_bytes_per_step'], '{:.2f}', 1e-6)} | {cell(r['intra_link_busy_ms'])} "
                     f"| {verdict_cell(r, best, summaries)} |")
    failed = [r["strategy"] for r in rows if r["status"] != "ok"]
    if failed:
        lines += ["", f"Did not run: {', '.join(failed)} (errors in that network's report)."]
    return [*lines, ""]
