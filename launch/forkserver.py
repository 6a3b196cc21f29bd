"""One rank of the sweep's pool: a process that has imported everything once and forks each run.

    python -m torch.distributed.run --standalone --nproc-per-node 4 -m launch.forkserver <pool dir>
    python -m launch.forkserver <pool dir>                                   # a pool of one process

launch.compare starts this, not you (parallel/compare/pool.py is the other end). A fresh
`launch.train` per strategy pays for torchrun and for every rank's interpreter importing torch
and Hydra; on a machine with fewer cores than ranks that start-up is a large share of a short
run. Here each rank imports launch.train once and then waits, blocked on its job pipe, taking
no core. For every job it forks: the child is launch.train on the job's overrides, under the
same torchrun environment (rank, world, node), and ends as launch.train ends. The parent never
runs a strategy, so every child starts from the same state a fresh process starts from: no
process group, thread, allocator setting, core binding or memory of an earlier strategy. Its
peak memory is a fresh process's: it starts from what it inherits, the imports a fresh process
also holds, with its parent's library pages mapped again (`map_again` says why).

Each job brings its own rendezvous: the address of a store the sweep opened for that run alone,
so that no key of an earlier run's process groups is ever read by a later one.

The parent reports each child's exit status to the sweep. A failed child ends its parent with
the same status, so torchrun stops the other ranks as it stops a failed launch.train's, and the
sweep starts a new pool for the next run.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import sys
import traceback
from pathlib import Path

from launch import train as launch_train
from launch.config import CONFIG_DIR, unknown_preset
from parallel.compare.pool import DONE, JOBS
from parallel.dist.groups import LaunchEnv, exit_process, exit_with_error

PAGE = os.sysconf("SC_PAGE_SIZE")
MADV_POPULATE_READ = 22  # Linux 5.14's madvise(2) advice: fault the range's pages in, as a read would
_PRESENT = bytes(0x31 if byte & 0x80 else 0x30 for byte in range(256))  # a pagemap entry's top byte -> "1"/"0"


def mapped_file_pages() -> list[tuple[int, int]]:
    """(address, length) of every run of pages of a file mapping (the libraries' code and data) that
    this process has in its page table (/proc/self/pagemap: bit 63 of each page's entry)."""
    runs = []
    with open("/proc/self/maps") as maps, open("/proc/self/pagemap", "rb", buffering=0) as pagemap:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) < 6 or fields[4] == "0" or not fields[5].startswith("/"):
                continue  # anonymous memory (the heap, stacks): a fork's page table has it already
            start, end = (int(x, 16) for x in fields[0].split("-"))
            pagemap.seek(start // PAGE * 8)
            present = pagemap.read((end - start) // PAGE * 8)[7::8].translate(_PRESENT)
            runs += [(start + m.start() * PAGE, (m.end() - m.start()) * PAGE) for m in re.finditer(rb"1+", present)]
    return runs


def map_again(runs: list[tuple[int, int]]) -> None:
    """Put the parent's file pages back in this fork's page table, so that its resident memory
    starts where a fresh process's does. The kernel copies a parent's anonymous pages into a
    fork's page table but leaves its file pages out, to be faulted in on the next touch: without
    this, a fork's peak memory would leave out every library page the imports touched and the
    run does not touch again, and read lower than the same run started fresh."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    for address, length in runs:
        if libc.madvise(address, length, MADV_POPULATE_READ) != 0:  # an older kernel: touch each page
            for page in range(address, address + length, PAGE):
                ctypes.string_at(page, 1)


def run_child(job: dict, env: LaunchEnv, file_pages: list[tuple[int, int]]) -> None:
    """launch.train on the job's overrides, its output to the job's files. Never returns."""
    try:
        map_again(file_pages)
        for fd, name in ((1, "stdout"), (2, "stderr")):
            target = os.open(job[name], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            os.dup2(target, fd)
            os.close(target)
        if job.get("master_port"):
            os.environ.update(MASTER_ADDR=job["master_addr"], MASTER_PORT=str(job["master_port"]))
        overrides = job["overrides"]
        unknown = unknown_preset(overrides)
        if unknown:
            exit_with_error(env, unknown)
        cfg = compose_config(overrides, env)
        launch_train.run(cfg, env)
    except BaseException:  # noqa: BLE001 - whatever happens, the child must not return into the loop
        traceback.print_exc()
        exit_process(1)
    exit_process(0)


def compose_config(overrides: list[str], env: LaunchEnv):
    """The config launch.train's @hydra.main would hand over for these overrides; a mistake is
    one line from rank 0 and exit 1, as Hydra's own report under torchrun ends."""
    from hydra import compose, initialize_config_dir

    try:
        with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
            return compose(config_name="config", overrides=overrides)
    except Exception as e:  # noqa: BLE001 - Hydra's and OmegaConf's errors have no common base
        exit_with_error(env, " ".join(str(e).split()), code=1)


def cuda_refusal() -> str | None:
    """Why this process must not fork a run, or None: a fork of a process that has initialised CUDA
    cannot use CUDA at all (torch refuses: "Cannot re-initialize CUDA in forked subprocess"), so a
    rank of the pool never touches it; each forked run initialises its own."""
    import torch

    if torch.cuda.is_initialized():
        return ("a rank of the sweep's pool initialised CUDA before forking its runs, which then cannot use CUDA: "
                "nothing imported by launch/forkserver.py may call into torch.cuda")
    return None


def serve(pool_dir: Path) -> int:
    """Fork one child per job line until the pipe ends or a child fails; the exit status to leave with."""
    env = LaunchEnv.from_environ()
    refusal = cuda_refusal()
    if refusal:
        print(f"error: {refusal}", file=sys.stderr, flush=True)
        return 1
    done = os.open(pool_dir / DONE, os.O_WRONLY)
    with open(pool_dir / JOBS.format(rank=env.rank), "rb") as jobs:
        for line in iter(jobs.readline, b""):
            job = json.loads(line)
            sys.stdout.flush()
            sys.stderr.flush()
            file_pages = mapped_file_pages()
            pid = os.fork()
            if pid == 0:
                os.close(done)
                jobs.close()
                run_child(job, env, file_pages)
            _, status = os.waitpid(pid, 0)
            code = os.waitstatus_to_exitcode(status)
            os.write(done, f"{job['id']} {env.rank} {code}\n".encode())
            if code != 0:
                return code if code > 0 else 128 - code  # killed by a signal: as a shell reports it
    return 0


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit("usage: python -m launch.forkserver <pool dir> (started by launch.compare)")
    exit_process(serve(Path(sys.argv[1])))


if __name__ == "__main__":
    main()
