"""Each ZeRO strategy's `checkpoint_pieces()` with real gloo ranks: after a step, the parts the ranks
write on their own read back to exactly the whole state the strategy gathers (parameters, both Adam
moments, the step count), and each rank's tensor bytes are its shard's closed form. One spawn of 2
ranks checks ZeRO-1, ZeRO-2 and ZeRO-3 (FSDP2's row chunks run in tests/runs/test_checkpoint.py)."""

import torch
import torch.distributed as dist
from spawn import run_ranks, write_result

from parallel.core.data import GlobalBatches, load_corpus, local_microbatches
from parallel.core.model import GPT, GPTConfig
from parallel.dist.comm import CommLog, Communicator
from parallel.reliability.sharded import load_state, wait_for_parts, write_manifest, write_rank_part
from parallel.sync.shards import group_into_parts
from parallel.zero.strategy import ZeroDataParallel
from parallel.zero.zero3 import Zero3

CONFIG = GPTConfig(vocab_size=256, seq_len=16, n_layers=2, d_model=32, n_heads=2)


def _strategy(stage: int, comm: Communicator):
    model = GPT(CONFIG, seed=0)
    if stage == 3:
        return Zero3(model, comm, lr=1e-3, weight_decay=0.1)
    return ZeroDataParallel(model, comm, stage, lr=1e-3, weight_decay=0.1)


def _check(rank: int, world: int, out_dir, stage: int) -> dict:
    comm = Communicator("dp", dist.group.WORLD, CommLog(enabled=False, timed=False))
    strategy = _strategy(stage, comm)
    batch = GlobalBatches(load_corpus(None, 100_000, 17), 16, 4, seed=0)(0)
    strategy.train_step(local_microbatches(batch, rank, world, 1), batch.n_tokens)
    whole_model, whole_optim = strategy.full_state_dict(), strategy.full_optimizer_state()  # collective
    tmp = out_dir / f"zero{stage}"
    state = strategy.checkpoint_pieces()
    write_rank_part(tmp, rank, state)
    parts = group_into_parts(list(GPT(CONFIG, seed=0).named_parameters()), world, rank)
    closed_form = 12 * sum(max(0, min(p.hi, p.numel) - p.lo) for p in parts)
    same = True
    if rank == 0:
        wait_for_parts(tmp, world, timeout_s=30)
        write_manifest(tmp, world)
        model_state, optim_state = load_state(tmp)
        same = optim_state["step"] == whole_optim["step"] == 1 and all(
            torch.equal(model_state[n], t) for n, t in whole_model.items()) and all(
            torch.equal(optim_state["state"][n][m], t) for n, s in whole_optim["state"].items() for m, t in s.items())
    return {"same": bool(same), "bytes": state.nbytes(), "closed_form": closed_form}


def _worker(rank: int, world: int, out_dir) -> None:
    write_result(out_dir, rank, {str(stage): _check(rank, world, out_dir, stage) for stage in (1, 2, 3)})


def test_zero_ranks_write_their_shards_and_they_read_back_whole():
    results = run_ranks(2, _worker)
    for stage in ("1", "2", "3"):
        assert results[0][stage]["same"], stage
        assert all(r[stage]["bytes"] == r[stage]["closed_form"] for r in results), (stage, results)
    whole = 12 * sum(p.numel() for p in GPT(CONFIG, seed=0).parameters())
    assert sum(r["3"]["bytes"] for r in results) == whole
