"""The registry: one table that the rest of the project reads, gathered from the families' entries;
the one table of what runs (parallel/compose/route.py); and a strategy added in one module."""

import subprocess
import sys

import pytest
from launcher import CPU_ONLY, PROJECT_ROOT, TINY, assert_ok, check_matches_single

from parallel.dist.dims import ParallelDims
from parallel.registry import REGISTRY, register, spec_of
from parallel.spec import StrategySpec


def test_every_preset_names_a_registered_strategy():
    import yaml

    presets = sorted((PROJECT_ROOT / "conf" / "parallel").glob("*.yaml"))
    assert presets
    names = {yaml.safe_load(p.read_text()).get("name") for p in presets} - {None}
    assert names <= set(REGISTRY), names - set(REGISTRY)


def test_every_strategy_has_its_theory_and_a_description():
    for name, spec in REGISTRY.items():
        assert spec.name == name and spec.description and callable(spec.build) and callable(spec.comm)


def test_counterparts_are_registered_baselines():
    for spec in REGISTRY.values():
        if spec.counterpart is not None:
            assert "baseline" in spec_of(spec.counterpart).tags, spec.name


def test_the_registry_is_every_familys_entries_in_order():
    """REGISTRY is built from each family's ENTRIES (and the reference, single), nothing else."""
    from parallel import baselines, compose, cp, diloco, dp, moe, pp, tp, zero
    from parallel.registry import SINGLE

    families = (dp, zero, tp, pp, compose, baselines, moe, cp, diloco)
    declared = [SINGLE, *(e for family in families for e in family.ENTRIES)]
    assert [REGISTRY[s.name] for s in declared] == declared
    assert [s.name for s in declared] == list(REGISTRY)[:len(declared)]


def test_the_route_table_names_only_entries_that_exist():
    """Every row of compose/route.py's table names entries of the registry; a name it does not have is
    refused when the table is checked (at import), not in some run, and so is a refusal that is not one."""
    from parallel.compose import route

    assert len(route.ROUTES) > 10
    route.check_names(REGISTRY)
    with pytest.raises(AssertionError, match="route table names"):
        route.check_names(REGISTRY, (route.route("epp", "ep=1", "any", "dp"), *route.ROUTES))
    with pytest.raises(AssertionError):
        route.check_names(REGISTRY, (route.route(route.ZERO_DP, "any", "1-3", "refused: no_such_rule"),))
    with pytest.raises(ValueError, match="not a condition on a dimension"):
        route.route("dp", "tp>>1", "any", "single").matches(REGISTRY["dp"], ParallelDims(2, 2), 0)


def test_an_entry_naming_an_option_its_family_lacks_is_refused():
    """A misspelt family or option in an entry's `honours` would read as an option it does not take:
    registering it is refused, naming the name."""
    def entry(name, honours):
        return StrategySpec(name=name, description="a typo", build=lambda *a: None, comm=lambda *a: {},
                            honours=honours)

    with pytest.raises(ValueError, match="TPOptions has no option 'sequence_paralel'"):
        register(entry("typo_option", {"tp": ("sequence_paralel",)}))
    with pytest.raises(ValueError, match="names family 'tpp'"):
        register(entry("typo_family", {"tpp": ()}))
    assert "typo_option" not in REGISTRY and "typo_family" not in REGISTRY


def test_a_name_is_registered_once():
    with pytest.raises(ValueError, match="registered twice"):
        register(StrategySpec(name="dp", description="again", build=lambda *a: None, comm=lambda *a: {}))


def _toy(args, run_dir, nproc=2):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(PROJECT_ROOT / "tests" / "helpers" / "toy_strategy.py"), *args, f"run.dir={run_dir}"]
    import os

    return subprocess.run(cmd, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, **CPU_ONLY})


def test_a_toy_strategy_is_one_module_and_one_entry(single_run, tmp_path):
    """tests/helpers/toy_strategy.py adds `dp_flat` without touching another file; launch.train runs it,
    and it trains the single-process model while sending exactly theory's bytes."""
    from launcher import Run

    proc = _toy([*TINY, "parallel=dp", "parallel.name=dp_flat", "train.save_final=true"], tmp_path / "toy")
    run = Run(proc.returncode, proc.stdout, proc.stderr, tmp_path / "toy")
    summary = assert_ok(run)
    assert summary["strategy"] == "dp_flat" and summary["comm_matches_theory"] is True
    assert set(summary["comm"]["by_tag"]) == {"grads/flat"}
    assert summary["memory"]["matches_formula"] is True
    check_matches_single(run, single_run)


def test_a_strategy_without_checkpoints_is_refused_in_one_line(tmp_path):
    proc = _toy([*TINY, "parallel=dp", "parallel.name=dp_flat", "train.checkpoint_every=2"], tmp_path / "refused")
    assert proc.returncode == 1, proc.stderr[-2000:]  # torchrun's status for a failed worker (the worker's own: 2)
    line = ("error: train.checkpoint_every=2: parallel=dp_flat cannot save or load checkpoints "
            "(its registry entry says checkpoints=False)")
    assert proc.stderr.count(line) == 1, proc.stderr[-2000:]  # said once, by rank 0
