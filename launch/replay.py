"""Replay a saved run on other links, without rerunning it: what-ifs in virtual time.

    python -m launch.replay <run dir> net=<preset> [net.inter_mbit=200 ...]   another (emulated) network
    python -m launch.replay <run dir> cluster=<preset>                        a cluster's links, compute
                                                                                scaled by the FLOP rates
    python -m launch.replay <run dir> cores=2                                 the run's own links, N ranks
                                                                                sharing 2 cores (contention)
    python -m launch.replay <run dir> cores=2 loopback=unbound                the same on this machine's
                                                                                loopback probed now with its
                                                                                ranks not bound, as a run with
                                                                                more ranks than cores meets it
                                                                                on an idle machine (the wait
                                                                                for a core then counts twice:
                                                                                a comparison, not the check);
                                                                                probes=N: the median of N probe
                                                                                runs (default 3; 1 is quicker,
                                                                                and as noisy as one probe)
    python -m launch.replay <run dir> cores=bound                             the run's own links, each rank
                                                                                on the core the run bound it to,
                                                                                the ranks of a core sharing it
                                                                                (a run made with
                                                                                train.pin_cores=round_robin)
    python -m launch.replay <run dir>                                         the run's own replay again
    python -m launch.replay <run dir> comm_cpu=free                           the communication taking no CPU
                                                                                of the ranks' cores (a device's
                                                                                copy engine; charged by default)

It reads the events every run saves (events/rank<r>.json: parallel/replay/events.py) and the
run's summary.json, replays every timed step (parallel/replay/), prints the step, its breakdown
(and beside them the run's own wall step and breakdown) and what it now waits on, and writes
summary.json (the run's, its `virtual` block replaced and a `replayed_from` added),
trace_virtual.json and timeline_virtual.png into a new directory (`out=<dir>`; default
<run dir>/replay-<what>, never the run's own files).

On a cluster the compute is scaled by the ratio of one device's peak here (a core: the measured
peak over the usable cores) to the cluster's per-GPU peak (conf/cluster/<preset>.yaml, the
planner's figures, parallel/planner/cluster.py): that is a what-if, and labelled so: it keeps this
run's efficiency, and a GPU's kernels would not scale as a CPU's do.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from omegaconf import OmegaConf

from parallel.replay import events as saved
from parallel.replay.links import LinkModel, from_cluster, from_net
from parallel.report.virtual import peak_per_device, write_virtual

CONF = Path(__file__).resolve().parent.parent / "conf"
USAGE = __doc__.split("\n\n")[1]


class ReplayError(ValueError):
    pass


def _value(text: str):
    """A command-line value as YAML reads it: 200 -> 200, null -> None, block -> "block"."""
    import yaml

    return yaml.safe_load(text)


def parse(argv: list[str]) -> tuple[Path, dict]:
    if not argv or argv[0].startswith("-") or "=" in argv[0]:
        raise ReplayError(f"usage:\n{USAGE}")
    run_dir, options = Path(argv[0]), {"fields": {}}
    for arg in argv[1:]:
        if "=" not in arg:
            raise ReplayError(f"{arg!r}: expected key=value (net=, net.<field>=, cluster=, cores=, loopback=, probes=, "
                              "comm_cpu=, out=)")
        key, value = arg.split("=", 1)
        if key.startswith("net."):
            options["fields"][key[4:]] = _value(value)
        elif key == "cores":
            if value != "bound":
                try:
                    if float(value) <= 0:
                        raise ValueError
                except ValueError:
                    raise ReplayError(f"cores={value!r}: how many cores the ranks share (a number above 0), or "
                                      "bound (each rank on the core the run bound it to)") from None
            options[key] = value
        elif key in ("net", "cluster", "out"):
            options[key] = value
        elif key == "loopback":
            if value not in ("run", "unbound"):
                raise ReplayError(f"loopback={value!r}: run (the run's own loopback figures, the default) or unbound "
                                  "(probed now, two ranks not bound to cores, as a run with more ranks than cores "
                                  "meets its loopback)")
            options[key] = value
        elif key == "probes":
            if not value.isdigit() or int(value) < 1:
                raise ReplayError(f"probes={value!r}: how many probe runs loopback=unbound takes the median of, "
                                  "a whole number of at least 1 (default 3)")
            options[key] = int(value)
        elif key == "comm_cpu":
            if value not in ("charged", "free"):
                raise ReplayError(f"comm_cpu={value!r}: charged (the communication's CPU shares each rank's core, "
                                  "the default) or free (it takes none: a device's copy engine)")
            options[key] = value
        else:
            raise ReplayError(f"unknown option {key!r}: net=, net.<field>=, cluster=, cores=, loopback=, probes=, "
                              "comm_cpu=, out=")
    if "probes" in options and options.get("loopback") != "unbound":
        raise ReplayError("probes= is the number of loopback probe runs: it goes with loopback=unbound (the run's "
                          "own figures need none)")
    return run_dir, options


def links_for(options: dict, summary: dict, events: list[dict]) -> tuple[LinkModel, float, float | None, str]:
    """(link model, compute scale, peak per device, label) for the options."""
    world = len(events)
    own = summary.get("virtual") or {}
    if "link_model" not in own:
        raise ReplayError("the run's summary.json has no virtual link model: " + (
            own.get("skipped") or "an older run, or its replay failed"))
    base = LinkModel.from_dict(own["link_model"])
    loop = base if base.name == "loopback" else LinkModel("loopback", base.intra, source=base.source)
    if options.get("loopback") == "unbound":
        if "cluster" in options:
            raise ReplayError("loopback=unbound with cluster=: a cluster's links are the preset's, not this machine's")
        if base.name != "loopback" and "net" not in options and not options["fields"]:
            raise ReplayError(f"loopback=unbound: the run's own links are {base.name}'s, not loopback's; "
                              "give net=none, or a net= what-if built on the loopback")
        base = loop = unbound_loopback(str((summary.get("config") or {}).get("train", {}).get("gloo_loop_policy")
                                           or "batch"), options.get("probes", 3))
    if "cluster" in options:
        from parallel.planner.cluster import cluster_from_config

        path = CONF / "cluster" / f"{options['cluster']}.yaml"
        if not path.exists():
            raise ReplayError(f"cluster={options['cluster']}: no {path.relative_to(CONF.parent)}")
        c = cluster_from_config(OmegaConf.to_container(OmegaConf.load(path)), world=world)
        links = from_cluster(c.name, c.gpus_per_node, c.intra_bytes_per_s, c.inter_bytes_per_s, c.intra_latency_s,
                             c.inter_latency_s, world, c.comm_efficiency)
        here = peak_per_device(summary, events)
        scale = here / c.peak_flops
        label = (f"cluster={c.name}: compute scaled by {scale:.3g} (one device's peak here {here:.3g} FLOP/s over the "
                 f"cluster's {c.peak_flops:.3g}), links from the preset")
        return links, scale, c.peak_flops, label
    if "net" in options or options["fields"]:
        preset = options.get("net", (summary.get("config") or {}).get("net", {}).get("name", "none"))
        path = CONF / "net" / f"{preset}.yaml"
        if not path.exists():
            raise ReplayError(f"net={preset}: no {path.relative_to(CONF.parent)}")
        settings = {**OmegaConf.to_container(OmegaConf.load(path)), **options["fields"]}
        nodes, per_node = int(settings.get("nodes") or 1), int(settings.get("procs_per_node") or 0) or world
        if preset != "none" and nodes * per_node != world:
            raise ReplayError(f"net={preset} has {nodes} x {per_node} ranks, the run {world}: set net.nodes and "
                              "net.procs_per_node to match")
        settings["procs_per_node"] = per_node
        links = from_net(settings, loop) if preset != "none" else loop
        changed = ", ".join(f"{k}={v}" for k, v in options["fields"].items())
        return links, 1.0, None, f"net={preset}" + (f" ({changed})" if changed else "")
    return base, 1.0, None, f"the run's own links ({base.name})"


def unbound_loopback(gloo_loop_policy: str, probes: int = 3) -> LinkModel:
    """This machine's loopback probed now with its two ranks not bound to cores (the median of
    `probes` probe runs, parallel/replay/probe.py): what a run with more ranks than cores, whose ranks
    are not bound, meets. A replay on it is as repeatable as the probe, not to the bit."""
    from parallel.replay.probe import link_of, measure_once

    runs = "one probe run" if probes == 1 else f"the median of {probes} probe runs"
    return link_of(measure_once(probes, gloo_loop_policy=gloo_loop_policy, pin_cores="off"),
                   f"probed now by launch.replay, two ranks not bound to cores, {runs}")


def shared_cores(option: str | None, events: list[dict]) -> float | list | None:
    """The engine's `cores` for the `cores=` option: None (a core per rank), a number of cores all
    ranks share, or (`bound`) the core each rank was bound to."""
    if option is None:
        return None
    if option != "bound":
        return float(option)
    placement = saved.placement(events)
    if placement is None:
        raise ReplayError("cores=bound: the run did not bind each rank to one core (its events name the cores each "
                          "rank could run on, and one has several, or none: a run saved before they were recorded); "
                          "make it with train.pin_cores=round_robin, or give cores=<how many the ranks shared>")
    return placement


def replay(run_dir: Path, options: dict) -> tuple[Path, dict]:
    summary_path = run_dir / "summary.json"
    if not summary_path.exists():
        raise ReplayError(f"{run_dir}: no summary.json (not a run directory, or the run did not finish)")
    summary = json.loads(summary_path.read_text())
    events = saved.load(run_dir)
    links, scale, peak, label = links_for(options, summary, events)
    cores = shared_cores(options.get("cores"), events)
    suffix = "" if cores is None else "-cores_bound" if isinstance(cores, list) else f"-cores{options['cores']}"
    name = options.get("out") or f"replay-{(options.get('cluster') or options.get('net') or 'own')}" + (
        "".join(f"-{k}{v}" for k, v in options["fields"].items()) + suffix
        + ("-loopback_unbound" if options.get("loopback") == "unbound" else "")
        + ("-comm_cpu_free" if options.get("comm_cpu") == "free" else ""))
    out = run_dir / name if "out" not in options else Path(name)
    out = _fresh(out)
    what_if = label if "cluster" in options else None
    comm_cpu = {"charged": True, "free": False}.get(options.get("comm_cpu"))
    block = write_virtual(out, events, summary, links, draw=True, cores=cores, compute_scale=scale, what_if=what_if,
                          peak=peak, comm_cpu=comm_cpu)
    if isinstance(cores, list):
        label += "; each rank on the core the run bound it to, the ranks of a core sharing it"
    elif cores:
        label += f"; the ranks sharing {cores:g} cores"
    if options.get("loopback") == "unbound":
        label += "; the loopback probed now, its ranks not bound to cores"
    if comm_cpu is False:
        label += "; the communication taking none of the ranks' CPU"
    block["replay"] = label
    summary["virtual"] = block
    summary["replayed_from"] = {"run_dir": str(run_dir), "what": label, "command": "python -m launch.replay "
                                + " ".join([str(run_dir)] + sys.argv[2:] if sys.argv[1:2] == [str(run_dir)] else [])}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return out, block


def _fresh(path: Path) -> Path:
    """`path`, or path-2, path-3, ...: never a directory that holds files already."""
    candidate, n = path, 1
    while candidate.exists() and any(candidate.iterdir()):
        n += 1
        candidate = path.with_name(f"{path.name}-{n}")
    candidate.mkdir(parents=True, exist_ok=True)
    return candidate


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"


def _parts(breakdown: dict, step: float) -> str:
    return " | ".join(f"{k.replace('_', ' ')} {_ms(v)} ({v / step:.0%})" for k, v in breakdown.items()) if step else ""


def describe(block: dict, run: dict | None = None) -> str:
    """The replay in words; `run`: the saved run's summary.json, whose wall step and breakdown are
    printed beside the replay's (where they differ by category with the same step, the replay put
    the time in another place: processor sharing stretches compute where the machine's scheduler
    runs ranks in turns and lengthens their waits)."""
    step = block["step_time_s"]
    wall = (run or {}).get("step_time_s")
    lines = [f"replayed: {block['replay']}" + (" [WHAT-IF]" if block.get("what_if") else ""),
             f"virtual step {_ms(step)} | {block['tokens_per_s']:.0f} tokens/s"
             + (f" | wall step of the run {_ms(wall)}" if wall else ""),
             f"breakdown (mean over ranks): {_parts(block['time_breakdown_s'], step)}"]
    if wall and (run or {}).get("time_breakdown_s"):
        lines.append(f"the run's wall breakdown (mean over ranks): {_parts(run['time_breakdown_s'], wall)}")
    lines.append(f"waits on: {block['waits_on']}")
    if block.get("communication_cpu_s") is not None:
        lines.append(f"communication's CPU, charged to the ranks' cores: {_ms(block['communication_cpu_s'])} "
                     "a rank (gloo's threads while its ops were in flight, the calling thread in its calls)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        run_dir, options = parse(argv)
        out, block = replay(run_dir, options)
    except (ReplayError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(describe(block, json.loads((run_dir / "summary.json").read_text())))
    print(f"wrote {out / 'summary.json'}, {out / 'trace_virtual.json'}, {out / 'timeline_virtual.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
