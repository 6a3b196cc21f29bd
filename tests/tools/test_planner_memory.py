"""Activation memory: the registry's formula (parallel/activations.py) against the bytes autograd
really saves, measured on every rank, for every strategy that has a formula; and the planner's
model-state formula against the tensors each rank holds.

One torchrun job of 4 gloo processes (tests/helpers/planner_memory_check.py) trains every layout two steps,
each on its own mesh: dp with microbatches, ZeRO 1-3, tp and tp with sequence parallelism at
tp 2 and 4 (and saving the column-parallel inputs' sequence pieces, parallel.tp_saves=sharded, on tp and 3d),
the three pipeline schedules (4 stages, and 2 stages x dp 2), 3-D with sequence
parallelism and with ZeRO-1, recomputation on a pipeline's walk and over tp (1F1B with full, interleaved
with selective, 3-D with sequence parallelism and either, tp with sequence parallelism and full), the split
backwards (ZB-H1, and 3-D with it; ZB-V and DualPipeV on the V placement), and PyTorch's
DDP, accelerate and FSDP2; on the tiny GPT-2 block and on Llama's (tiny_llama: tp 4 over its 2 kv heads
replicates them; sequence parallelism with and without the saved piece). The formula counts every storage,
so it is met exactly.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from launcher import CPU_ONLY, PROJECT_ROOT

from parallel.core.model import GPTConfig
from parallel.dist.dims import ParallelDims
from parallel.registry import REGISTRY, layout_of

# Llama's block (GQA, SwiGLU, RMSNorm, RoPE): a layout of each kind, tp and sequence parallelism included.
LLAMA_LAYOUTS = ["single", "dp m2", "zero1", "zero2 m2", "zero3", "tp 2x2", "tp_sp tp4", "tp_sp 2x2 sharded",
                 "pp_gpipe p4", "pp_1f1b dp2 p2 m4", "pp_interleaved p4 v2", "3d tp2 pp2 sp m4", "pp_1f1b p4 full",
                 "3d tp2 pp2 sp sharded selective m4", "3d tp2 dp2 sp zero2", "pp_interleaved dp2 p2 v2 zero2",
                 "3d tp2 pp2 sp sharded zbh1 m4", "3d tp2 pp2 sp zbh1 full m4", "torch_ddp", "accelerate_ddp",
                 "torch_fsdp2"]


@pytest.mark.parametrize("model,labels", [("tiny", []), ("tiny_llama", LLAMA_LAYOUTS)], ids=["tiny", "tiny_llama"])
def test_saved_bytes_and_model_state_equal_the_formulas_for_every_strategy(model, labels):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
           str(PROJECT_ROOT / "tests" / "helpers" / "planner_memory_check.py"), model, *labels]
    proc = subprocess.run(cmd, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, **CPU_ONLY})
    assert proc.returncode == 0 and "done" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-6000:]
    results = dict(line.split("\t") for line in proc.stdout.splitlines() if "\t" in line)
    assert len(results) == (len(labels) or 34), results.keys()
    for label, text in results.items():
        r = json.loads(text)
        assert r["formula"] is not None, f"{label}: the registry has no activation formula"
        assert len(r["formula"]) == len(r["measured"]), label
        for rank, (measured, formula) in enumerate(zip(r["measured"], r["formula"])):
            assert measured > 0, f"{label} rank {rank}: nothing measured"
            assert abs(formula - measured) <= 0.02 * measured, f"{label} rank {rank}: {formula} != {measured}"
        # Exact, not just within 2%: every saved storage is in the formula.
        assert r["formula"] == r["measured"], label
        if label not in ("torch_ddp", "accelerate_ddp", "torch_fsdp2"):  # baselines: the planner plans ours
            assert r["state"] == r["state_formula"], f"{label}: model state {r['state']} != {r['state_formula']}"
    # Pipelines hold different amounts on different stages (1F1B's first stage p microbatches, its
    # last one), which is what the per-rank formula must get right.
    assert len(set(json.loads(results["pp_1f1b dp2 p2 m4"])["measured"])) == 2
    # Saving the sequence piece keeps less than the gathered input on every rank of the same layout.
    pairs = (("tp_sp 2x2", "tp_sp 2x2 sharded"), ("3d tp2 pp2 sp m4", "3d tp2 pp2 sp sharded m4"))
    for gathered, sharded in (pair for pair in pairs if set(pair) <= set(results)):
        assert all(s < g for g, s in zip(json.loads(results[gathered])["measured"],
                                         json.loads(results[sharded])["measured"])), (gathered, sharded)


# A mixture of experts (tiny_moe: 4 experts, top-2, in blocks 0 and 2; tiny_llama_moe: the same in the
# Llama-style block, SwiGLU experts): one process, dp with microbatches, ZeRO-1 and -3, and expert
# parallelism (dp 4 x ep 2 with microbatches, ep 4).
MOE_LAYOUTS = ["single", "dp m2", "zero1", "zero3", "ep 4x2 m2", "ep4"]


@pytest.mark.parametrize("model", ["tiny_moe", "tiny_llama_moe"])
def test_moe_saved_bytes_and_model_state_equal_the_planners_formulas(model):
    """The planner's MoE formula (parallel/planner/moe.py) on the routing each rank measured, to the byte on
    every rank: the saved set follows the routing (no padding to capacity), so ranks differ."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
           str(PROJECT_ROOT / "tests" / "helpers" / "planner_memory_check.py"), model, *MOE_LAYOUTS]
    proc = subprocess.run(cmd, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, **CPU_ONLY})
    assert proc.returncode == 0 and "done" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-6000:]
    results = {label: json.loads(text) for label, text in
               (line.split("\t") for line in proc.stdout.splitlines() if "\t" in line)}
    assert sorted(results) == sorted(MOE_LAYOUTS)
    for label, r in results.items():
        assert r["formula"] == r["measured"] and all(m > 0 for m in r["measured"]), label
        assert r["state"] == r["state_formula"], f"{label}: model state {r['state']} != {r['state_formula']}"
    assert len(set(results["ep4"]["measured"])) > 1  # the routing differs by rank, and so do the bytes


def test_strategies_without_a_formula_say_so():
    """PyTorch's DTensor TP and pipelining save other tensors than ours: their entries have none, so
    the summary and the planner show no formula rather than a wrong one."""
    cfg = GPTConfig()
    layout = layout_of(ParallelDims(world_size=2, dp=1, tp=2))
    assert REGISTRY["torch_tp"].activations(cfg, layout) is None
    assert REGISTRY["tp"].activations(cfg, layout) is not None


def test_recomputation_under_a_split_backward_has_a_formula():
    """A zero-bubble schedule's B recomputes while the chunk's graph is kept until W: the walk holds the
    rerun beside everything in flight (the first virtual stage's whole backward in W as 1F1B's), derived
    and measured on every rank (the `zbh1 ... selective` and `... full` layouts above)."""
    cfg = GPTConfig(n_layers=8)
    dims = ParallelDims.resolve(4, pp=4)
    for schedule in ("zbh1", "1f1b"):
        for recompute in ("none", "selective", "full"):
            layout = layout_of(dims, microbatches=4, schedule=schedule, recompute=recompute)
            assert REGISTRY["pp"].activations(cfg, layout) is not None, (schedule, recompute)


def test_the_two_activation_derivations_agree_where_both_apply():
    """The registry's one-stage formula (activations.activation_bytes) and the planner's per-rank call
    are the same derivation (parallel/activations.py): the same bytes where both apply."""
    from parallel.activations import activation_bytes
    from parallel.core.model import GPTConfig
    from parallel.dist.dims import ParallelDims
    from parallel.layout import Layout
    from parallel.planner.memory import activation_bytes_by_rank

    cfg = GPTConfig(seq_len=32, n_layers=4, d_model=64, n_heads=4)
    for world, b, m in ((1, 16, 1), (2, 8, 1), (2, 4, 2), (4, 4, 1)):
        layout = Layout(dims=ParallelDims.resolve(world), microbatches=m, microbatch_size=b)
        assert activation_bytes(cfg, layout) == activation_bytes_by_rank(cfg, layout, world * m * b, act_bytes=4)
