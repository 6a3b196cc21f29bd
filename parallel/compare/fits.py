"""What a sweep can run: the remedies for slow links ask things of the network and of the run's length.

Hybrid sharding (hsdp, hsdp_zero2, torch_hsdp; docs/hsdp.md) shards over groups of parallel.dp_shard
consecutive ranks and replicates across them. On a network where the world holds a single shard
group (2 ranks with dp_shard = 2: `ethernet_1g`), there is nothing to replicate across, and the run
would be ZeRO over every rank under another name; where a shard group cannot lie inside one node
(dp_shard not dividing the ranks per node, or cyclic placement), the group meant to stay on the
fast links would cross the slow one. Such a cell of the sweep is skipped: its row says `skipped`
and why, the console names it, and the rest of the sweep runs (`skip_reason`).

DiLoCo (parallel=diloco, docs/diloco.md) syncs once every parallel.inner_steps (H) steps. A run whose
timed steps (train.steps minus the warm-up) are fewer than H holds no sync among them: its bytes
and time per step would leave out the one all-reduce it makes, and its row would say it moves
nothing. Such a sweep is refused before anything runs, with the steps that fit (`refuse_short_runs`).
Timed steps that are a whole number of periods (steps = warm-up + k·H) make the link counters'
mean per step exactly the closed form's.
"""

from __future__ import annotations

import sys

from hydra import compose
from hydra.errors import MissingConfigException

from parallel.compare.networks import Network, NetworkRefused
from parallel.dist.timing import default_warmup_steps


def preset(strategy: str, overrides: list[str]) -> dict:
    """The `parallel` section a run of `strategy` gets (its preset and the sweep's parallel.* overrides)."""
    own = dict(compose(config_name="config", overrides=[f"parallel={strategy}"]).parallel)
    # An override of a field this preset lacks is left out here: its run refuses it, in its own row.
    given = [o for o in overrides
             if o.startswith("parallel.") and o[len("parallel."):].partition("=")[0].split(".")[0] in own]
    return dict(compose(config_name="config", overrides=[f"parallel={strategy}", *given]).parallel) if given else own


def skip_reason(parallel: dict, network: Network, world: int) -> str | None:
    """Why hybrid sharding cannot run as itself at `world` on `network` (None: it can, or it is not HSDP)."""
    shard = int(parallel.get("dp_shard") or 1)
    if shard <= 1 or world == 1:
        return None
    dp = world // (int(parallel.get("tp") or 1) * int(parallel.get("pp") or 1) * int(parallel.get("cp") or 1))
    if dp < 2 * shard or dp % shard:
        return (f"dp={dp} ranks hold {dp / shard:g} shard group(s) of "
                f"parallel.dp_shard={shard}; hybrid sharding needs at least two to replicate across "
                f"(a world of {2 * shard} or more, e.g. net=cluster's 2 x 2)")
    spec = network.spec
    if network.emulated and (spec.placement != "block" or spec.procs_per_node % shard):
        return (f"a shard group of parallel.dp_shard={shard} consecutive ranks would "
                f"span nodes ({spec.nodes} x {spec.procs_per_node}, {spec.placement} placement), putting ZeRO's "
                "gathers on the slow link; give dp_shard a divisor of net.procs_per_node with block placement")
    return None


def refuse_short_runs(strategies: list[str], overrides: list[str], steps: int, warmup: int | None) -> None:
    """NetworkRefused where a periodic strategy (DiLoCo's H) would hold no sync in the timed steps."""
    warmup = default_warmup_steps(steps) if warmup is None else warmup
    for strategy in strategies:
        try:
            h = int(preset(strategy, overrides).get("inner_steps") or 1)
        except MissingConfigException:  # a name without a preset fails in its own row
            continue
        if steps - warmup < h:
            raise NetworkRefused(
                f"{strategy} syncs every parallel.inner_steps={h} steps, but the runs time {steps - warmup} "
                f"(train.steps={steps} minus {warmup} warm-up): no sync would be timed and its bytes and step "
                f"would leave the all-reduce out; give train.steps={warmup + h} or more (warm-up + k x {h} "
                "for an exact mean per step)")


def finish(results: list[tuple[Network, list[dict], dict]], multi: bool) -> None:
    """Name what was skipped (and why), and exit 1 where a run failed: the sweep is then not whole."""
    def where(row: dict, network: Network) -> str:
        return row["strategy"] + (f" on {network.label}" if multi else "")

    for network, rows, _ in results:
        for row in (r for r in rows if r["status"] == "skipped"):
            print(f"skipped {where(row, network)} ({row['world']} ranks): {row['error']}", flush=True)
    failed = [where(r, n) for n, rows, _ in results for r in rows if r["status"] not in ("ok", "skipped")]
    total = sum(len(rows) for _, rows, _ in results)
    if failed or total == 0:
        # Everything that ran is written above; the exit status says the sweep is not whole.
        print(f"error: {len(failed)} of {total} {'runs' if multi else 'strategies'} did not run: "
              f"{', '.join(failed) or 'compare.strategies is empty'}", file=sys.stderr, flush=True)
        sys.exit(1)
