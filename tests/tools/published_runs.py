"""Published dense-transformer training runs the planner is checked against, each with its configuration,
its measured throughput, where it comes from, and whether a parameter was chosen on it.

`split` says what the planner may have learnt from a row:

    FIT        the one row per cluster kind its preset's `efficiency` is fitted on (the preset's
               `calibration` block names it; `fit_efficiency` below is the bisection)
    IN_SAMPLE  rows of the table a time-model term was chosen with (Megatron's Table 1: the GEMM depth
               term); reported, but not evidence that the planner predicts
    HELD_OUT   every other row: no parameter, term or preset figure was chosen on it

The rule was fixed before any prediction was looked at: the fit row is the first row of the first
published table of each cluster kind (a100_80gb: Narayanan et al. 2021 Table 1, row 1.7B; h100_sxm:
Dubey et al. 2024 Table 4, the 8,192-GPU row); everything not in Table 1 and not a fit row is held out.

A row's `metric` is what its source measured: `tflops` (TFLOP/s per GPU, counted with `flops`) or `step_s`
(seconds per optimizer step). `flops` names the source's own count: `megatron_hfu` 96·B·s·l·h²(1 + s/6h +
V/16lh) (Narayanan et al. 2021, eq. 3, the recomputed forward included), `planner` the planner's own
hardware FLOPs (where the source does not give its formula).
Lives here, beside its test, because only tests and docs read it: the planner never does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

A100, H100, H200 = "a100_80gb", "h100_sxm", "h200"
FIT, IN_SAMPLE, HELD_OUT = "FIT", "IN_SAMPLE", "HELD_OUT"


@dataclass(frozen=True)
class Run:
    name: str
    source: str
    cluster: str
    split: str
    model: dict  # conf/model preset under "preset", and model.* overrides
    gpus: int
    batch: int  # sequences per optimizer step
    micro: int  # sequences per microbatch
    parallel: dict  # parallel.* of conf/parallel/3d.yaml
    recompute: str
    metric: str  # tflops | step_s
    published: float
    flops: str | None = None  # megatron_hfu | planner (None with step_s)
    sure: str = ""  # how sure the configuration and figure are, and what is assumed
    cluster_overrides: dict = field(default_factory=dict)


def gpt(heads: int, h: int, layers: int, vocab: int = 51200, seq: int = 2048) -> dict:
    """A Megatron GPT shape on the gpt2_1p5b preset (GeLU MLP of 4h, learned positions, LayerNorm)."""
    return {"preset": "gpt2_1p5b", "n_layers": layers, "d_model": h, "n_heads": heads, "vocab_size": vocab,
            "seq_len": seq}


def megatron_table_1() -> list[Run]:
    """Narayanan et al. 2021 (SC21, arXiv 2104.04473) Table 1, as tests/tools/test_planner_published.py
    evaluates it (microbatch, DDP kind and chunks from the paper's examples/sc21/run_table_1.sh)."""
    from test_planner_published import DDP, TABLE_1

    out = []
    for i, (name, heads, h, layers, tp, pp, gpus, batch, tflops, micro, ddp, v) in enumerate(TABLE_1):
        parallel = {"tp": tp, "pp": pp, "grad_sync": DDP[ddp], "virtual_stages": v,
                    "schedule": "interleaved_1f1b" if v > 1 else "1f1b"}
        out.append(Run(f"GPT {name}", "Narayanan et al. 2021, arXiv 2104.04473, Table 1", A100,
                       FIT if i == 0 else IN_SAMPLE, gpt(heads, h, layers), gpus, batch, micro, parallel, "full",
                       "tflops", tflops, "megatron_hfu", "sure: the paper's table and its own run script"))
    return out


KORTHIKANTI = "Korthikanti et al. 2022, arXiv 2205.05198, Table 5 (iteration time, A100 80GB, dp 1)"
KORTHIKANTI_SURE = ("step times sure (Table 5; the same figures are Calculon's validation profile, Isaev et al. SC23, "
                    "calculon/megatron/validation.py); shapes, tp, pp, dp 1 sure (Table 3; Megatron-LM's README: 'a "
                    "data parallel size of one'); global batch, microbatch and interleaving as Calculon's "
                    "validation/<model>_<full|seqsel>.json read them (22B: B 4, b 4; 175B: B 64, b 1, 3 chunks; "
                    "530B: B 280, b 1, 3 chunks; 1T: B 512, b 1, 1F1B): fairly sure")
MEGATRON_2022_TP = ("Megatron-LM of the paper's time overlaps backward's tensor-parallel communication with the "
                    "GEMMs (megatron/mpu/layers.py: ColumnParallelLinearWithAsyncAllreduce all-reduces the input "
                    "gradient with async_op=True while the weight gradient is computed, on unless "
                    "--no-async-tensor-model-parallel-allreduce; under sequence parallelism, then named "
                    "model_parallel_memory_opt, the input's all-gather runs beside the input-gradient GEMM and the "
                    "reduce-scatter beside the weight-gradient GEMM): tp_backward_overlap")
MTNLG = "Smith et al. 2022 (MT-NLG 530B), arXiv 2201.11990, section 2.4"
MTNLG_SURE = ("step time sure (60.1/50.2/44.4 s at 280/350/420 DGX A100 nodes, global batch 1920, quoted by "
              "llm-analysis' MT-NLG example); tp 8 x pp 35 sure (paper and Microsoft's blog); microbatch 1, "
              "full recomputation, ZeRO-1 and DeepSpeed's 1F1B assumed (the three published times fit a "
              "microbatch of 2: docs/log/2026-12-06-mt-nlg-microbatch.md)")
BLOOM = ("BigScience 2022, BLOOM 176B: bigscience-workshop/bigscience, train/tr11-176B-ml/README.md (a logged "
         "iteration at global batch 2048: 104.70 s, 149.77 TFLOP/s)")
BLOOM_SURE = ("step time, shape, tp 4 x pp 12 x dp 8, microbatch 2, global batch 2048, full recomputation (DeepSpeed "
              "activation checkpointing), ZeRO-1 (its BF16_Optimizer) and stages of 5, 6 x 10, 5 blocks "
              "(embedding on the first and last) sure (the README); Jean Zay's 4 x 100 Gb/s Omni-Path per node of 8 "
              "A100s (BLOOM paper, arXiv 2211.05100) taken as 50 Gb/s per GPU at a100_80gb's 90% busbw rule: assumed; "
              "its dropout 0.1 left out (1-byte masks: a few % of the elementwise traffic)")
DEEPSPEED_P2P = ("DeepSpeed's pipeline engine sends activations with blocking broadcasts on two-rank groups "
                 "(deepspeed/runtime/pipe/p2p.py: dist.broadcast, async_op=False): not overlapped with compute")
DEEPSPEED_PIPE = ("after the last microbatch DeepSpeed's TrainSchedule (deepspeed/runtime/pipe/schedule.py) runs "
                  "ReduceTiedGrads, ReduceGrads and OptimizerStep in line, as the planner times ZeRO-1's reduction and "
                  "all-gather (exposed); not modelled: its engine (pipe/engine.py, is_pipe_partitioned under tp) sends "
                  "each tp rank's 1/t of an activation and all-gathers it on the receiver while gradients go whole, "
                  "and a broadcast holds the receiving stage as long as the sender (by a simulation of that schedule, "
                  "the two about cancel against the planner's sends on the sender's path)")
LLAMA3 = "Dubey et al. 2024 (Llama 3), arXiv 2407.21783, Table 4"
LLAMA3_SURE = ("TFLOP/s sure (430/400/380, also Balaji, SC24 talk, as quoted by glennklockwood.com); tp, cp, pp, dp "
               "and sequences per dp group (32/16/16) sure (Table 4; the cp 16 row's dp is printed 4 in some copies, 8"
               " in others: 8 is what 16,384 GPUs and 16M tokens need); section 3.3.2 states: no activation "
               "checkpointing at 8K tokens; the interleaved schedule with V chunks a rank and N contiguous "
               "microbatches tunable between depth-first (N = PP) and breadth-first (N = M), V and N of the 405B runs "
               "not given; one layer fewer on the first and the last stage, the first chunk holding only the embedding"
               " and the last only the output and loss (not expressible: pp_layers counts are positive; taken as 4 "
               "chunks of 2 layers, 1 on the first and the last, the same 7 or 8 layers a rank); stage inputs and "
               "outputs deallocated (counted by neither formula here beyond what the blocks save); FSDP sharding "
               "optimizer states and gradients but not the parameters after forward, with fp32 gradient accumulation "
               "and reduce-scatter (taken as ZeRO-2: gradients reduce-scattered every microbatch, in bf16); tp citing "
               "Korthikanti et al. (taken as their sequence parallelism, which saves each rank's piece of the linears' "
               "inputs: parallel.tp_saves=sharded); context parallelism all-gathering K and V (taken as the ring, the "
               "kind the sandbox has that saves the same per token). Assumed: microbatch 1; the planner's FLOP count "
               "(attention without causal skipping, as Megatron counts it), the paper giving none")


def korthikanti() -> list[Run]:
    """Each model twice: full recomputation with tensor parallelism alone, and sequence parallelism with
    selective recomputation (the paper's 'present work')."""
    # name, heads, h, layers, pp, global batch, microbatch, chunks per rank, seconds (full; SP + selective)
    shapes = [("22B", 64, 6144, 48, 1, 4, 4, 1, 1.42, 1.10),
              ("175B", 96, 12288, 96, 8, 64, 1, 3, 18.13, 13.75),
              ("530B", 128, 20480, 105, 35, 280, 1, 3, 49.05, 37.83),
              ("1T", 160, 25600, 128, 64, 512, 1, 1, 94.42, 71.49)]
    out = []
    for name, heads, h, layers, pp, batch, micro, v, full_s, seqsel_s in shapes:
        for recompute, sp, step in (("full", False, full_s), ("selective", True, seqsel_s)):
            # Megatron-LM's sequence parallelism keeps each rank's piece of the linears' inputs, not the gathered
            parallel = {"tp": 8, "pp": pp, "sequence_parallel": sp, "grad_sync": "naive", "virtual_stages": v,
                        "schedule": "interleaved_1f1b" if v > 1 else "1f1b", **({"tp_saves": "sharded"} if sp else {})}
            label = "SP + selective" if sp else "full recompute"
            out.append(Run(f"GPT {name}, {label}", KORTHIKANTI, A100, HELD_OUT, gpt(heads, h, layers), 8 * pp,
                           batch, micro, parallel, recompute, "step_s", step, None,
                           f"{KORTHIKANTI_SURE}; {MEGATRON_2022_TP}", {"tp_backward_overlap": True}))
    return out


def mt_nlg() -> list[Run]:
    return [Run(f"MT-NLG 530B, {nodes} nodes", MTNLG, A100, HELD_OUT, gpt(128, 20480, 105, vocab=50272),
                nodes * 8, 1920, 1, {"tp": 8, "pp": 35, "zero": 1, "schedule": "1f1b"}, "full", "step_s", step,
                None, f"{MTNLG_SURE}; {DEEPSPEED_P2P}; {DEEPSPEED_PIPE}", {"p2p_overlap": False})
            for nodes, step in ((280, 60.1), (350, 50.2), (420, 44.4))]


def bloom() -> list[Run]:
    model = gpt(112, 14336, 70, vocab=250880)  # its dropout 0.1 left out: the sandbox refuses dropout under tp
    parallel = {"tp": 4, "pp": 12, "zero": 1, "schedule": "1f1b", "pp_layers": [5] + [6] * 10 + [5]}
    links = {"inter_gbit_per_s": 50, "inter_busbw_gbytes_per_s": 5.6, "p2p_overlap": False}
    return [Run("BLOOM 176B", BLOOM, A100, HELD_OUT, model, 384, 2048, 2, parallel, "full", "step_s", 104.70, None,
                f"{BLOOM_SURE}; {DEEPSPEED_P2P}; {DEEPSPEED_PIPE}", links)]


def llama3_405b() -> list[Run]:
    chunks = [1] + [2] * 62 + [1]  # 16 stages x 4 chunks: one layer fewer on the first and the last
    rows = [(8192, 1, 8192, 2048, 430, FIT), (16384, 1, 8192, 2048, 400, HELD_OUT),
            (16384, 16, 131072, 128, 380, HELD_OUT)]
    out = []
    for gpus, cp, seq, batch, tflops, split in rows:
        parallel = {"tp": 8, "pp": 16, "cp": cp, "sequence_parallel": True, "tp_saves": "sharded", "zero": 2,
                    "schedule": "interleaved_1f1b", "virtual_stages": 4, "pp_layers": chunks}
        out.append(Run(f"Llama 3 405B, {gpus} GPUs, cp {cp}", LLAMA3, H100, split,
                       {"preset": "llama3_405b", "seq_len": seq}, gpus, batch, 1, parallel, "none", "tflops", tflops,
                       "planner", LLAMA3_SURE))
    return out


def all_runs() -> list[Run]:
    return [*megatron_table_1(), *korthikanti(), *mt_nlg(), *bloom(), *llama3_405b()]
