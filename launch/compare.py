"""Every strategy and PyTorch's own, one after another on the same model and data, side by side.

    python -m launch.compare                                             # the whole sweep, world 4, model=small
    python -m launch.compare compare.world=2 'compare.strategies=[single,dp,tp,pp_1f1b]' model=tiny train.steps=4
    python -m launch.compare compare.timeout_s=60 'compare.overrides=["parallel.microbatches=4"]' '+compare.worlds.tp=2'
    python -m launch.compare compare.rounds=3 'compare.strategies=[dp,torch_ddp]'   # median and min-max of 3 rounds
    python -m launch.compare net=cluster 'compare.strategies=[dp,tp,pp_1f1b]'     # on an emulated network (root)
    python -m launch.compare 'compare.nets=[none,ethernet_1g,cluster]'             # once per network + crossover

Not run under torchrun itself: each strategy (a preset of conf/parallel/) is one launch.train run
with a timeout, given the model, data and train settings and `run.dir=<sweep dir>/<strategy>`;
the sweep then reads that run's summary.json. On net=none the runs of one world are forked from a
pool of ranks started once (one torchrun of launch.forkserver, plain python for `single`:
parallel/compare/pool.py), each still a process of its own with process groups of its own;
`compare.pool=false` starts a fresh torchrun per run instead. A strategy that fails or times out
gets a row with its error; the sweep goes on. One that cannot be itself on a network (HSDP without two
shard groups inside nodes) is skipped, its row says why; DiLoCo without a sync in the timed steps is
refused before anything runs (parallel/compare/fits.py). The runs draw no timeline (run.timeline=false): the
sweep draws those its report shows, from their trace.json.
With `compare.rounds=N` the sweep runs N times, its order rotated each round with each of ours
beside its PyTorch counterpart (run dirs <sweep dir>/round<k>/<strategy>), and each row holds the
median and min-max over the rounds (parallel/compare/rounds.py).
The report (results.csv, results.json, report.md, PNG plots) goes to `run.dir`
(default runs/<time>-compare-w<world>), and the short table (120 columns) to the console.

On an emulated network (`net=<preset>`, docs/network.md, docs/network-sweep.md) each run is
`python -m launch.run` on the
network's nodes, at its world (parallel/compare/networks.py says how the world is derived and
which mismatches are refused); the rows gain the network's columns and report.md says, for the
network, which layout is best and what the others wait on. `compare.nets=[...]` runs the whole
sweep once per network (<sweep dir>/<network>/, each a complete report) and then writes the rows
of all of them, crossover.png and a report across the networks (parallel/compare/crossover.py).
net=none, the default, runs exactly as before.

Each element of `compare.overrides` is a `key=value` override and must be quoted inside the list:
Hydra reads an unquoted `=` there as a syntax error, so an unquoted one is refused here first,
with the quoted form to use.
"""

from __future__ import annotations

import json
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import hydra
import torch
from hydra import compose
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from launch.config import CONFIG_DIR, unquoted_overrides
from launch.run import Refused, check_privileges
from parallel.algebra import parameter_count
from parallel.compare.clock import leading_clock, one_thread_per_rank
from parallel.compare.clock import sentence as clock_sentence
from parallel.compare.crossover import console_lines, write_all
from parallel.compare.devices import Machine, sweep_machine
from parallel.compare.fits import finish, preset, refuse_short_runs, skip_reason
from parallel.compare.networks import (
    Network,
    NetworkRefused,
    check_worlds,
    explicit_keys,
    from_entry,
    from_group,
    network_verdict,
    strategy_world,
)
from parallel.compare.pool import Pools, pools_supported
from parallel.compare.report import console_table, write_report
from parallel.compare.rounds import aggregate_rounds, round_order, rows_by_round
from parallel.net.netns import remove_leftovers
from parallel.replay.probe import figure_overrides, given_figures, measure_once
from parallel.report.mfu import PEAK_DTYPES, measure_peak_flops
from parallel.run_plan import model_config
from parallel.runner import run_one


def run_command(strategy: str, world: int, overrides: list[str]) -> list[str]:
    if world == 1:
        return [sys.executable, "-m", "launch.train", f"parallel={strategy}", *overrides]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
            "-m", "launch.train", f"parallel={strategy}", *overrides]


def section_overrides(cfg: DictConfig, section: str) -> list[str]:
    """Every resolved field of a config section as `section.key=value`, so that whatever the user
    overrode here (model=tiny, model.n_layers=2, train.steps=3) reaches each run unchanged."""
    values = OmegaConf.to_container(cfg[section], resolve=True)
    values.pop("peak_flops", None)  # compare passes its own, measured once for the whole sweep
    return _flat_overrides(section, values)


def _flat_overrides(prefix: str, values: dict) -> list[str]:
    """`prefix.key=value` for each field, a nested group's fields by their dotted path (train.chaos.seed=0)."""
    found = []
    for k, v in values.items():
        if isinstance(v, dict):
            found.extend(_flat_overrides(f"{prefix}.{k}", v))
        else:
            found.append(f"{prefix}.{k}={json.dumps(v) if isinstance(v, str) else ('null' if v is None else v)}")
    return found


def missing_preset(strategy: str) -> str | None:
    """A sweep name without a conf/parallel/ preset fails at once, without starting a run."""
    if (Path(CONFIG_DIR) / "parallel" / f"{strategy}.yaml").exists():
        return None
    return f"no preset conf/parallel/{strategy}.yaml: not a strategy of this checkout"


def swept_counterparts(strategies: list[str]) -> dict[str, str]:
    """Each swept preset of ours -> the swept preset of its PyTorch counterpart (the registry's
    `counterpart`, with the same pipeline schedule), so that the rounds keep the two side by side.
    The presets are composed as launch.train composes them; the ratios themselves are paired
    later from what the runs report (parallel/compare/rows.py)."""
    from parallel.registry import REGISTRY

    kinds = {}
    for name in strategies:
        if missing_preset(name):
            continue
        p = compose(config_name="config", overrides=[f"parallel={name}"]).parallel
        kinds[name] = (p.name, p.get("schedule"))
    partners = {}
    for name, (kind, schedule) in kinds.items():
        counterpart = REGISTRY[kind].counterpart if kind in REGISTRY else None
        theirs = next((other for other, k in kinds.items() if k == (counterpart, schedule)), None)
        if theirs is not None:
            partners[name] = theirs
    return partners


def progress(done: int, total: int, text: str, width: int = 24) -> str:
    filled = round(width * done / total)
    return f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {text}"


def load_reference(path: str) -> list[float]:
    p = Path(path)
    if p.is_dir():
        p = p / "summary.json"
    return json.loads(p.read_text())["losses"]


def model_choice() -> str:
    """The model preset picked on the command line (`small`, `tiny`, ...), for the report's heading."""
    return HydraConfig.get().runtime.choices.get("model", "?")


def default_sweep_dir(networks: list[Network], multi: bool) -> Path:
    """runs/<time>-compare-w<world> (net=none), -compare-<network> or -compare-nets."""
    network = networks[0]
    name = "nets" if multi else (network.dir_name if network.emulated else f"w{network.world}")
    return Path("runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-compare-{name}"


def warmup_of(summaries: list[dict], cfg_warmup) -> str:
    """The warm-up steps the runs used (each run resolves train.warmup_steps=null itself)."""
    used = "/".join(map(str, sorted({s["warmup_steps"] for s in summaries}))) or str(cfg_warmup)
    return f"{used} warm-up" + (" (train.warmup_steps=null: min(3, half of the steps))" if cfg_warmup is None else "")


def networks_of(cfg: DictConfig) -> list[Network]:
    """The networks to sweep: compare.nets, or else the `net` group (net=none: one sweep on the loopback).
    Refuses (NetworkRefused) what cannot run, before anything does."""
    c = cfg.compare
    world_given, worlds_given, net_given = explicit_keys(list(HydraConfig.get().overrides.task))
    if c.get("nets") is not None:
        if net_given:
            raise NetworkRefused("compare.nets lists the networks, and net= / net.* was given too: put that network "
                                 "in the list, e.g. 'compare.nets=[none,{preset:cluster,inter_mbit:200}]'")
        if not c.nets:
            raise NetworkRefused("compare.nets=[] has no network: list presets of conf/net/, or leave it null")
        networks = [from_entry(CONFIG_DIR, entry, c.world) for entry in c.nets]
        labels = [n.label for n in networks]
        twice = sorted({label for label in labels if labels.count(label) > 1})
        if twice:
            raise NetworkRefused(f"compare.nets lists {', '.join(twice)} twice: give one of them a label:, e.g. "
                                 "{preset:cluster,inter_mbit:200,label:slow}")
    else:
        networks = [from_group(CONFIG_DIR, cfg.net, c.world)]
    check_worlds(networks, c, list(c.strategies), world_given, worlds_given)
    for network in (n for n in networks if n.emulated):
        try:
            check_privileges(network.spec)  # launch.run's: root (or the capabilities) and iproute2
        except Refused as e:
            raise NetworkRefused(str(e)) from None
    return networks


def run_command_on(network: Network, strategy: str, world: int, overrides: list[str]) -> list[str]:
    """One run on `network`: the plain command on none (and for one process anywhere: no links), else
    launch.run on the network's nodes."""
    if not network.emulated or world == 1:
        return run_command(strategy, world, overrides)
    return [sys.executable, "-m", "launch.run", *network.launch_overrides(), f"parallel={strategy}", *overrides]


def tensorboard_override(cfg: DictConfig, sweep_dir: Path, run_dir: Path) -> list[str]:
    """With train.tensorboard=true, each run's events go to <sweep dir>/tensorboard/<strategy> (or
    <round>/<strategy>), one TensorBoard run per strategy: `tensorboard --logdir <sweep dir>/tensorboard`
    overlays them. A train.tensorboard_dir given to the sweep is overridden per run."""
    if not cfg.train.get("tensorboard", False):
        return []
    return [f"train.tensorboard_dir={sweep_dir / 'tensorboard' / run_dir.relative_to(sweep_dir)}"]


def run_strategy(cfg: DictConfig, network: Network, strategy: str, world: int, run_dir: Path, sweep_dir: Path,
                 common: list[str], pools: Pools | None) -> tuple[str, str, float]:
    """One run: (status, error, seconds). A name without a preset fails at once; on net=none the run
    is forked in the pool of its world (parallel/compare/pool.py), elsewhere (an emulated network,
    or compare.pool=false) it is a fresh command."""
    missing = missing_preset(strategy)
    if missing:
        return "failed", missing, 0.0
    skipped = skip_reason(preset(strategy, list(cfg.compare.overrides)), network, world)
    if skipped:  # hybrid sharding where it cannot be itself (parallel/compare/fits.py)
        return "skipped", skipped, 0.0
    overrides = [*common, f"run.dir={run_dir}", *tensorboard_override(cfg, sweep_dir, run_dir)]
    cmd = run_command_on(network, strategy, world, overrides)
    if pools is not None and not network.emulated:
        return pools.run(world, cmd, [f"parallel={strategy}", *overrides], run_dir, cfg.compare.timeout_s)
    result = run_one(cmd, run_dir, cfg.compare.timeout_s)
    if network.emulated:
        remove_leftovers()  # a launch.run stopped past its grace period leaves its namespaces
    return result


def run_rounds(cfg: DictConfig, network: Network, sweep_dir: Path, common: list[str],
               label: str) -> tuple[list[dict], list[list[str]]]:
    """Every run of every round, in each round's order: the runs (their summaries read back) and the orders."""
    c = cfg.compare
    rounds, strategies = c.get("rounds", 1), list(c.strategies)
    runs, orders, total = [], [], rounds * len(strategies)
    partners = swept_counterparts(strategies) if rounds > 1 else {}
    with Pools() if c.get("pool", True) and pools_supported() else nullcontext() as pools:
        for k in range(rounds):
            orders.append(round_order(strategies, k, partners))
            for strategy in orders[-1]:
                world = strategy_world(strategy, c, network)
                run_dir = sweep_dir / strategy if rounds == 1 else sweep_dir / f"round{k}" / strategy
                prefix = label + (f"round {k}: " if rounds > 1 else "")
                print(progress(len(runs), total, f"{prefix}running {strategy} (world {world})"), flush=True)
                status, error, seconds = run_strategy(cfg, network, strategy, world, run_dir, sweep_dir, common, pools)
                summary = json.loads((run_dir / "summary.json").read_text()) if status == "ok" else None
                runs.append({"round": k, "strategy": strategy, "world": world, "run_dir": run_dir, "status": status,
                             "error": error, "seconds": seconds, "summary": summary})
                tail = f"{summary['tokens_per_s']:.0f} tokens/s" if summary else f"{status}: {error[:120]}"
                print(progress(len(runs), total, f"{prefix}{strategy}: {tail} ({seconds:.0f} s)"), flush=True)
    return runs, orders


def sweep_meta(cfg: DictConfig, network: Network, command: str, sweep_dir: Path, machine: Machine, peak: float,
               summaries: dict, orders: list[list[str]], clock: str, clock_line: str) -> dict:
    """results.json's meta: what ran, on what, with which settings."""
    c, model = cfg.compare, model_config(cfg.model)
    cores, unit = machine.capacity
    return {
        "command": command, "sweep_dir": str(sweep_dir), "model": model_choice(), "parameters": parameter_count(model),
        "steps": cfg.train.steps, "warmup_steps": warmup_of(list(summaries.values()), cfg.train.warmup_steps),
        "global_batch": cfg.train.global_batch, "seq_len": model.seq_len, "world": network.world, "peak_flops": peak,
        "peak_source": "given" if c.peak_flops else "measured", "torch": torch.__version__,
        "device": machine.name,
        "capacity": cores, "capacity_unit": unit, "rounds": c.get("rounds", 1), "orders": orders,
        "reference": c.reference or ("single" if "single" in summaries else None),
        "network": network.label, "network_settings": network.spec.as_dict(), "clock": clock,
        "clock_sentence": clock_line,
    }


def sweep_network(cfg: DictConfig, network: Network, sweep_dir: Path, common: list[str], machine: Machine,
                  peak: float, command: str, multi: bool) -> tuple[list[dict], dict[str, dict], dict]:
    """Every strategy (every round) on one network: its runs under `sweep_dir`, its results, report and
    plots there, its console table. Returns its rows (with the network columns), the summaries
    of each row's run, and the sweep's meta (results.json's)."""
    c = cfg.compare
    strategies = list(c.strategies)
    cores, _ = machine.capacity
    sweep_dir.mkdir(parents=True, exist_ok=True)
    label = f"{network.label}: " if multi else ""
    if multi:
        print(f"\n== network {network.label} ({network.describe()}) -> {sweep_dir}", flush=True)
    # The clock that leads the rows: virtual time when ranks outnumber the cores (parallel/compare/clock.py).
    max_world = max(strategy_world(strategy, c, network) for strategy in strategies)
    clock = leading_clock(c.get("clock", "auto"), machine.device_type, max_world, cores)
    clock_line = clock_sentence(clock, c.get("clock", "auto"), max_world, cores)
    print(clock_line, flush=True)

    # Rows are made once every run is done, when `single`'s losses (the reference) are known.
    # In virtual time a rank's device is a core per thread: one thread each, so that `single` is one core.
    runs, orders = run_rounds(cfg, network, sweep_dir, one_thread_per_rank(common, clock), label)
    reference = load_reference(c.reference) if c.reference else next(
        (r["summary"]["losses"] for r in runs if r["strategy"] == "single" and r["summary"]), None)
    per_round = rows_by_round(runs, strategies, len(orders), reference, cores, clock, network)
    rows = aggregate_rounds(per_round, strategies)
    # Each row's other figures (and plots, timelines) come from its median round's run.
    chosen = {row["strategy"]: next(r for r in runs if r["strategy"] == row["strategy"] and r["round"] == row["round"])
              for row in rows}
    summaries = {name: r["summary"] for name, r in chosen.items() if r["summary"]}
    meta = sweep_meta(cfg, network, command, sweep_dir, machine, peak, summaries, orders, clock, clock_line)
    # On an emulated network the report opens with the network: the best layout and what the others wait on.
    network_section = ["## On the network\n", *network_verdict(network, rows, summaries)] if network.emulated else None
    write_report(sweep_dir, meta, rows, per_round, summaries, {name: r["run_dir"] for name, r in chosen.items()},
                 network_section)
    print()
    print(console_table(rows))
    ok = sum(r["status"] == "ok" for r in rows)
    print(f"\n{label}{ok}/{len(rows)} strategies ran | report: {sweep_dir / 'report.md'} (results.csv, results.json, "
          "plots; the full table is in report.md)")
    return rows, summaries, meta


def loopback_overrides(cfg: DictConfig, machine: Machine) -> list[str]:
    """Virtual time's loopback link, probed once (two ranks, one per core) and given to every run,
    as the peak is: each run probing its own would put the probe's spread between the strategies."""
    given = given_figures(cfg.get("virtual") or {})
    if given is not None:
        return figure_overrides(given)
    if machine.device_type != "cpu":
        return []
    loop = measure_once(gloo_loop_policy=str(cfg.train.get("gloo_loop_policy", "batch")))  # as the runs set it
    print(f"compare: loopback for virtual time {loop['bytes_per_s'] / 1e9:.2f} GB/s per rank, "
          f"{loop['latency_s'] * 1e6:.0f} us per ring step, {loop['p2p_latency_s'] * 1e6:.0f} us per message "
          "(probed once, given to every run)", flush=True)
    return figure_overrides(loop)


@hydra.main(config_path=CONFIG_DIR, config_name="compare", version_base="1.3")
def sweep(cfg: DictConfig) -> None:
    c = cfg.compare
    rounds = c.get("rounds", 1)
    if not isinstance(rounds, int) or isinstance(rounds, bool) or rounds < 1:
        print(f"error: compare.rounds={rounds!r} must be a positive integer (1: one sweep)", file=sys.stderr,
              flush=True)
        sys.exit(2)
    try:
        networks = networks_of(cfg)
        refuse_short_runs(list(c.strategies), list(c.overrides), cfg.train.steps, cfg.train.warmup_steps)
    except NetworkRefused as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    multi = c.get("nets") is not None
    # Absolute: the runs start in the project root, whatever directory this was started from.
    sweep_dir = (Path(cfg.run.dir) if cfg.run.dir else default_sweep_dir(networks, multi)).resolve()
    sweep_dir.mkdir(parents=True, exist_ok=True)
    strategies = list(c.strategies)
    # This process never calls into CUDA (parallel/compare/devices.py): on a GPU a child asks it, and
    # measures the peak. Measured once, in the runs' compute dtype (train.precision), given to every run.
    machine = sweep_machine(None if c.peak_flops else cfg.train.precision)
    peak = float(c.peak_flops) if c.peak_flops else machine.peak_flops or measure_peak_flops(
        torch.device("cpu"), dtype=PEAK_DTYPES[cfg.train.precision])
    # The model preset first (a run's default is the dense `small`, which has no moe_* keys to set),
    # then every resolved field of it, so that what was overridden here reaches the runs.
    # The loopback is probed only for a sweep with something to run: a list of names without presets
    # (each fails at once, as its row says) starts no process.
    loopback = loopback_overrides(cfg, machine) if any(not missing_preset(s) for s in strategies) else []
    # The runs draw no timeline: the sweep draws the ones its report shows, from their trace.json.
    common = [f"model={model_choice()}", *section_overrides(cfg, "model"), *section_overrides(cfg, "data"),
              *section_overrides(cfg, "train"), f"train.peak_flops={peak}", *loopback, "run.timeline=false",
              *c.overrides]
    command = "python -m launch.compare " + " ".join(sys.argv[1:])
    on = f" x {len(networks)} networks" if multi else (f" on net={networks[0].label}" if networks[0].emulated else "")
    print(f"compare: {len(strategies)} strategies{on}{f' x {rounds} rounds' if rounds > 1 else ''} -> {sweep_dir} | "
          f"peak {peak:.3g} FLOP/s per device ({'given' if c.peak_flops else 'measured'}) on {machine.name}",
          flush=True)

    results, meta = [], {}
    for network in networks:
        out = sweep_dir / network.dir_name if multi else sweep_dir
        rows, summaries, meta = sweep_network(cfg, network, out, common, machine, peak, command, multi)
        results.append((network, rows, summaries))
    if multi:
        # The model, steps, peak ... are every network's; the world, order and network are each network's own.
        meta = {**meta, "sweep_dir": str(sweep_dir), "networks": [n.label for n in networks], "world": None,
                "orders": None, "network": None, "network_settings": {n.label: n.spec.as_dict() for n in networks}}
        write_all(sweep_dir, meta, results)
        print("\n" + "\n".join(console_lines([(n, rows) for n, rows, _ in results])))
        print(f"report across the networks: {sweep_dir / 'report.md'} (crossover.png, results.csv, results.json)")
    finish(results, multi)  # what was skipped and why; exit 1 where a run failed


def main() -> None:
    """Refuse an unquoted compare.overrides element in one line (before Hydra's own parse error), then sweep."""
    error = unquoted_overrides(sys.argv[1:])
    if error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        sys.exit(2)
    sweep()


if __name__ == "__main__":
    main()
