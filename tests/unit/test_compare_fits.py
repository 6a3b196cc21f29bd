"""What a sweep can run (parallel/compare/fits.py): hybrid sharding skipped, with the reason, where a
network cannot hold two shard groups each inside a node; a sweep refused before anything runs where
DiLoCo's timed steps would hold no sync; the crossover table's bytes and loss columns."""

import pytest
from hydra import initialize_config_dir

from launch.config import CONFIG_DIR
from parallel.compare.crossover import tokens_table
from parallel.compare.fits import preset, refuse_short_runs, skip_reason
from parallel.compare.networks import NetworkRefused, from_entry


def test_hybrid_sharding_is_skipped_where_it_cannot_be_itself():
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        hsdp, dp = preset("hsdp", []), preset("dp", [])
        wide = preset("torch_hsdp", ["parallel.dp_shard=4", "parallel.inner_steps=3"])  # a field it lacks: ignored
    net = {name: from_entry(CONFIG_DIR, name, 4) for name in ("none", "ethernet_1g", "cluster")}
    cyclic = from_entry(CONFIG_DIR, {"preset": "cluster", "placement": "cyclic"}, 4)
    assert skip_reason(hsdp, net["none"], 4) is None and skip_reason(hsdp, net["cluster"], 4) is None
    assert skip_reason(dp, net["ethernet_1g"], 2) is None and skip_reason(hsdp, net["cluster"], 1) is None
    # 2 ranks: one shard group, nothing to replicate across.
    assert "1 shard group(s) of parallel.dp_shard=2" in skip_reason(hsdp, net["ethernet_1g"], 2)
    # Two shard groups, but each would cross between the nodes.
    assert "would span nodes" in skip_reason(hsdp, cyclic, 4)
    assert wide["dp_shard"] == 4 and "1 shard group(s)" in skip_reason(wide, net["cluster"], 4)


def test_a_sweep_whose_timed_steps_hold_no_diloco_sync_is_refused():
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        refuse_short_runs(["dp", "diloco", "no_such_preset"], [], 13, None)  # 10 timed steps: one sync at H = 10
        with pytest.raises(NetworkRefused, match=r"give train.steps=58 or more"):
            refuse_short_runs(["dp", "diloco_h50"], [], 55, 8)
        with pytest.raises(NetworkRefused, match=r"inner_steps=4 steps, but the runs time 3"):
            refuse_short_runs(["diloco"], ["parallel.inner_steps=4"], 6, None)


def test_the_crossover_table_gives_the_bytes_per_link_class_once_per_family_and_the_loss():
    def row(strategy, network, inter, loss):
        return {"strategy": strategy, "network": network, "status": "ok", "world": 4,
                "tokens_per_s": 2000.0 if strategy == "diloco_h50" else 1000.0,
                "clock": "virtual", "wall_tokens_per_s": 300.0, "procs_per_node": 2, "tokens_per_step": 512,
                "inter_wire_bytes_per_step": inter, "intra_wire_bytes_per_step": 2e6, "final_loss": loss}

    cluster = from_entry(CONFIG_DIR, "cluster", 4)
    slow = from_entry(CONFIG_DIR, {"preset": "cluster", "inter_mbit": 200, "label": "slow"}, 4)
    results = [(cluster, [row("dp", "cluster", 1e6, 4.0), row("diloco_h50", "cluster", 2.1e4, 4.25)]),
               (slow, [row("dp", "slow", 1.01e6, 4.0), row("diloco_h50", "slow", 2e4, 4.3)])]
    table = tokens_table(results, 5120)
    head = "| strategy | cluster | slow | MB/step inter / intra (2 x 2, intra 10000 Mbit/s) | loss after 5,120 tokens |"
    assert head in table
    assert "| dp | 1000 / 300 wall | 1000 / 300 wall | 1 / 2 | 4.0000 |" in table
    assert "| diloco_h50 | **2000** / 300 wall | **2000** / 300 wall | 0.021 / 2 | 4.2500-4.3000 |" in table
