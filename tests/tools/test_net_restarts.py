"""Two failures in one job on two emulated nodes (launch.run, agent.max_restarts), and nothing lost.

One launch.run job, net=cluster (2 nodes x 2 ranks), restart_job.RESTART_JOB (10 steps, a
checkpoint every 2, train.resume=auto), agent.max_restarts=2:

  1. rank 1 (node 0) SIGKILLs itself before step 5 (train.fail_mode=kill, first attempt only):
     every worker goes down and both agents restart theirs through the c10d rendezvous;
  2. once the restarted job has logged step 6, launch.run SIGKILLs node 1's torchrun agent
     (agent_fault): it ends that node's workers and starts a fresh agent there, which joins the
     next round that node 0's agent opens for its failed workers.

The job exits 0, and its losses of steps 0-9 and its final parameters' hash are bitwise those of
the uninterrupted run (the `restart_reference` fixture). Cost: one job of about 40-60 s on a shared
2-core machine (three rounds of start-up, and about 5 s for the rendezvous to drop the dead agent).
"""

from net_launcher import require_network, run_net
from restart_job import KILL_RANK_1_AT_5, RESTART_JOB, check_repeats_reference


def test_a_killed_rank_then_a_killed_agent_cost_no_step(restart_reference, tmp_path):
    require_network()
    run = run_net([*RESTART_JOB, "net=cluster", "agent.max_restarts=2", *KILL_RANK_1_AT_5,
                   "agent_fault.node=1", "agent_fault.at_step=6"], tmp_path / "run", timeout=300)
    output = f"stdout:\n{run.stdout[-3000:]}\nstderr:\n{run.stderr[-5000:]}"
    assert run.returncode == 0, output
    assert "rank 1: injecting train.fail_mode=kill at step 5" in run.stderr, output
    assert "agent_fault: node 1's torchrun agent" in run.stderr, output
    assert "launch.run: node 1's agent died (SIGKILL); its workers are ended and a fresh agent starts there" \
        in run.stderr, output
    check_repeats_reference(run.summary, restart_reference.summary)
