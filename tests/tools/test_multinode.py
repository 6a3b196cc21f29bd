"""Two nodes on one machine: two torchrun agents, c10d rendezvous on loopback, world 4 = 2 x 2.

Each agent runs in its own directory, as two nodes without a shared filesystem would: global
rank 0 names the run directory and every rank uses that name, so each node holds one run
directory with its own ranks' logs, and only rank 0's node holds metrics.jsonl and summary.json.
The losses and final parameters must match the single-process run, exactly as on one node.
"""

import pytest
from launcher import TINY, Run, check_matches_single, run_nodes

from parallel.dist.dims import ParallelDims

# Layouts at world 4, with 2 processes per node (ranks 0-1 on one node, 2-3 on the other):
LAYOUTS = {
    # dp 4: the gradient all-reduce spans both nodes.
    "dp": (["parallel=dp"], {"dp": 4, "tp": 1, "pp": 1}),
    # dp 2 x tp 2: each tp group is one node's two ranks; the dp all-reduce crosses nodes.
    "tp": (["parallel=tp"], {"dp": 2, "tp": 2, "pp": 1}),
    # pp 2 x dp 2: stage 0 on one node, stage 1 on the other; activations cross nodes.
    "pp": (["parallel=pp_1f1b", "parallel.dp=2"], {"dp": 2, "tp": 1, "pp": 2}),
}


def _describe(nodes) -> str:
    return "\n".join(f"--- node {k} (exit {n.returncode})\nstdout:\n{n.stdout[-2000:]}\nstderr:\n{n.stderr[-2000:]}"
                     for k, n in enumerate(nodes))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_two_nodes_match_single_with_one_summary(layout, single_run, tmp_path):
    overrides, dims = LAYOUTS[layout]
    nodes = run_nodes(2, [*TINY, *overrides, "train.save_final=true"], [tmp_path / "node0", tmp_path / "node1"],
                      timeout=150)
    assert all(n.returncode == 0 for n in nodes), _describe(nodes)

    run_dirs = [sorted((n.workdir / "runs").iterdir()) for n in nodes]
    assert [len(d) for d in run_dirs] == [1, 1], run_dirs
    assert run_dirs[0][0].name == run_dirs[1][0].name, "every rank must use the directory rank 0 named"
    with_summary = [d[0] for d in run_dirs if (d[0] / "summary.json").exists()]
    assert len(with_summary) == 1, "exactly one summary.json, written by global rank 0"
    rank0_dir = with_summary[0]

    # torchrun numbers ranks node by node: one node holds ranks 0-1, the other 2-3, and each
    # rank's log names its node (GROUP_RANK) and local rank.
    logs = sorted(sorted(p.name for p in (d[0] / "logs").iterdir()) for d in run_dirs)
    assert logs == [["rank0.log", "rank1.log"], ["rank2.log", "rank3.log"]]
    assert (rank0_dir / "logs" / "rank0.log").exists()
    for d in run_dirs:
        for log in (d[0] / "logs").iterdir():
            rank = int(log.stem.removeprefix("rank"))
            assert f"rank {rank} | node {rank // 2} | local rank {rank % 2} of 2" in log.read_text()

    run = Run(0, _describe(nodes), "", rank0_dir)
    summary = run.summary
    assert summary["world_size"] == 4
    assert {k: summary["parallel"][k] for k in dims} == dims
    assert summary["comm_matches_theory"]
    check_matches_single(run, single_run)


@pytest.mark.parametrize("tp,per_node,world,spans", [
    (2, 2, 4, False),   # each tp pair is one node
    (2, 4, 8, False),
    (4, 2, 8, True),    # a tp group of 4 over nodes of 2
    (3, 2, 6, True),    # groups 0-2 and 3-5 straddle nodes 0-1 and 2-3 (ranks 2 and 3)
    (4, 4, 4, False),   # one node: nothing crosses a network
    (1, 3, 6, False),   # no tensor parallelism
])
def test_node_layout_warning_when_tp_groups_span_nodes(tp, per_node, world, spans):
    dims = ParallelDims.resolve(world, tp=tp)
    warning = dims.node_layout_warning(per_node)
    assert (warning is not None) == spans
    if spans:
        assert f"parallel.tp={tp} does not divide the {per_node} processes per node" in warning
