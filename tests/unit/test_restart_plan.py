"""In-process checks of what a restarted job relies on: `train.resume=auto`'s run directory and
checkpoint choice, the faults that fire in one attempt each, the parameter hash, and the recovery
entry's arithmetic. Fast: no process groups, no torchrun (tests/runs/test_restart.py runs them)."""

import pytest
import torch
from test_layout import plan_for

from parallel.core.model import GPT
from parallel.reliability.checkpoint import CheckpointError, checkpoint_meta, save_checkpoint
from parallel.reliability.params_hash import params_sha256
from parallel.reliability.recovery import STARTED, Attempt, Journal, recovery_block, recovery_entry
from parallel.reliability.resume import attempt_number
from parallel.run_plan import ConfigError, model_config
from parallel.strategy import SingleProcess, make_optimizer

TINY = ["model=tiny", "train.steps=10", "train.warmup_steps=1"]
JOB_VARS = ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT")


@pytest.fixture(autouse=True)
def no_launcher(monkeypatch):
    """As a plain `python` process: no torchrun or Slurm job around the test."""
    for name in JOB_VARS:
        monkeypatch.delenv(name, raising=False)


# -- resume=auto ---------------------------------------------------------------------------------
def test_auto_without_a_fixed_directory_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"train.resume=auto needs a run directory that every attempt of the job "
                                          r"shares: set run.dir=<dir>"):
        plan_for(1, *TINY, "train.resume=auto")


@pytest.mark.parametrize("variables,expected", [
    ({"TORCHELASTIC_RUN_ID": "abc"}, "runs/job-abc-dp-w2"),
    # Slurm's job id wins: a requeued job starts a new torchrun, whose --standalone id is new.
    ({"TORCHELASTIC_RUN_ID": "abc", "SLURM_JOB_ID": "77"}, "runs/job-77-dp-w2"),
])
def test_auto_names_the_run_directory_after_the_job(variables, expected, monkeypatch):
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    plan = plan_for(2, *TINY, "parallel=dp", "train.resume=auto")
    assert plan.run_dir == expected and plan.resume_auto and plan.resume_from is None and plan.start_step == 0


def _checkpoint(root, step, plan):
    model = GPT(plan.model, seed=0)
    strategy = SingleProcess(model, make_optimizer(model, 1e-3, 0.1))
    return save_checkpoint(root, step, strategy.full_state_dict(), strategy.full_optimizer_state(),
                           checkpoint_meta(plan, step))


def test_auto_resumes_the_newest_complete_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    fresh = plan_for(1, *TINY, "train.resume=auto", f"run.dir={run_dir}")
    assert (fresh.resume_from, fresh.start_step, fresh.run_dir) == (None, 0, str(run_dir))
    _checkpoint(run_dir / "checkpoints", 2, fresh)
    _checkpoint(run_dir / "checkpoints", 4, fresh)
    (run_dir / "checkpoints" / "step_000006.tmp-123").mkdir()  # a save killed before its rename
    plan = plan_for(1, *TINY, "train.resume=auto", f"run.dir={run_dir}")
    assert plan.resume_from == str(run_dir / "checkpoints" / "step_000004") and plan.start_step == 4
    # train.checkpoint_dir, where given, is where the job's checkpoints are.
    elsewhere = plan_for(1, *TINY, "train.resume=auto", f"run.dir={run_dir}", f"train.checkpoint_dir={tmp_path}/c")
    assert elsewhere.resume_from is None


# -- faults, one attempt each -----------------------------------------------------------------------
@pytest.mark.parametrize("attempt,expected", [(0, ("kill", 5, 1)), (1, ("kill_during_save", 8, 0)),
                                              (2, (None, None, 0))])
def test_each_fault_fires_in_its_own_attempt(attempt, expected, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(attempt))
    plan = plan_for(2, *TINY, "train.fail_mode=[kill,kill_during_save]", "train.fail_at_step=[5,8]",
                    "train.fail_rank=[1,0]", "train.checkpoint_every=2")
    assert (plan.fail_mode, plan.fail_at_step, plan.fail_rank, plan.attempt) == (*expected, attempt)


def test_a_resume_auto_job_counts_its_attempts_in_its_journal(tmp_path, monkeypatch):
    """A Slurm requeue or a replaced node agent starts torchrun's count at 0 again: the journal's
    `started` records (one per attempt that came up) still number the attempt, so the second
    fault of the list fires and not the first again."""
    run_dir = tmp_path / "run"
    faults = ["train.fail_mode=kill", "train.fail_at_step=[5,8]", "train.fail_rank=1", "train.resume=auto",
              f"run.dir={run_dir}"]
    assert plan_for(2, *TINY, *faults).attempt == 0
    run_dir.mkdir()
    Journal(run_dir, rank=0, attempt=0).append("started")
    Journal(run_dir, rank=1, attempt=0).fault(5, "kill")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    plan = plan_for(2, *TINY, *faults)
    assert (plan.attempt, plan.fail_at_step) == (1, 8)


@pytest.mark.parametrize("overrides,message", [
    (["train.fail_mode=[kill,raise,exit]", "train.fail_at_step=[5,8]"],
     r"train.fail_mode=\['kill', 'raise', 'exit'\] has 3 entries but train.fail_at_step has 2"),
    (["train.fail_mode=kill", "train.fail_at_step=[5,10]"], r"train.fail_at_step=10 must be a step this run reaches"),
    (["train.fail_mode=kill", "train.fail_at_step=[5,8]", "train.fail_rank=[1,2]"],
     r"train.fail_rank=2 must be a rank of this run, 0 to 1"),
])
def test_every_attempts_fault_is_checked_before_the_first(overrides, message):
    with pytest.raises(ConfigError, match=message):
        plan_for(2, *TINY, *overrides)


# -- the parameter hash -----------------------------------------------------------------------------
@pytest.mark.parametrize("preset", ["tiny", "tiny_llama"])
def test_the_hash_does_not_depend_on_how_the_state_was_sharded(preset):
    """The same full state, cut two ways and put back together as each layout's gather does (tp's
    rows, ZeRO's flat chunks), and in another key order, hashes the same; one ulp anywhere does not."""
    from omegaconf import OmegaConf

    from launch.config import CONFIG_DIR

    cfg = OmegaConf.load(f"{CONFIG_DIR}/model/{preset}.yaml")
    state = GPT(model_config(cfg), seed=3).state_dict()
    by_rows = {n: torch.cat(t.chunk(2, dim=0)) if t.dim() else t.clone() for n, t in state.items()}
    flat = {n: torch.cat(t.reshape(-1).chunk(4)).reshape(t.shape) for n, t in reversed(list(state.items()))}
    transposed = {n: t.t().contiguous().t() if t.dim() == 2 else t for n, t in state.items()}  # not contiguous
    reference = params_sha256(state)
    assert params_sha256(by_rows) == params_sha256(flat) == params_sha256(transposed) == reference
    name = sorted(state)[-1]
    nudged = dict(state, **{name: state[name].clone()})
    nudged[name].view(-1)[0] = torch.nextafter(nudged[name].view(-1)[0], torch.tensor(1.0))
    assert params_sha256(nudged) != reference


# -- the recovery entry -----------------------------------------------------------------------------
def test_recovery_entry_sets_the_parts_against_the_downtime(tmp_path):
    """Fault at 100.0, survivors see it at 100.1 and leave by 100.3, the new processes start at
    101.0 and have their groups at 103.0, then 0.5 s of set-up, 1.0 s of load and two recomputed
    steps of 0.25 s: 5.0 s of parts. The downtime is its own measurement (the new attempt back at the
    fault's step at 106.0), so 1.0 s is left unexplained rather than absorbed."""
    fault = {"time": 100.0, "rank": 1, "step": 5, "mode": "kill", "attempt": 0}
    stopped = [{"event": "detected", "time": 100.1}, {"event": "detected", "time": 100.2},
               {"event": "exited", "time": 100.3}]
    attempt = Attempt(None, process_start=101.0, groups_ready=103.0, setup_s=0.5, load_s=1.0, resumed_at=3)
    entry = recovery_entry(fault, stopped, attempt, recovered=106.0, step_times=[0.25, 0.25])
    assert entry["detection_s"] == pytest.approx(0.1) and entry["teardown_s"] == pytest.approx(0.2)
    assert entry["restart_s"] == pytest.approx(0.7) and entry["rendezvous_s"] == pytest.approx(2.0)
    assert entry["steps_recomputed"] == 2 and entry["recompute_s"] == pytest.approx(0.5)
    assert entry["explained_s"] == pytest.approx(5.0) and entry["downtime_s"] == pytest.approx(6.0)
    assert entry["unexplained_s"] == pytest.approx(1.0)


def test_the_next_attempt_finds_the_fault_and_journals_its_entry(tmp_path):
    before = Journal(tmp_path, rank=1, attempt=0)
    before.fault(5, "kill")
    Journal(tmp_path, rank=0, attempt=0).append("detected")
    attempt = Attempt.start(Journal(tmp_path, rank=0, attempt=1), groups_ready=0.0)
    assert attempt.pending["step"] == 5 and len(attempt.stopped) == 1
    assert attempt.reached(4, []) is None
    entry = attempt.reached(5, [0.1])
    assert entry["fault_step"] == 5 and attempt.pending is None
    block = recovery_block(Journal(tmp_path, rank=0, attempt=1))
    assert len(block) == 1 and block[0]["recovered_attempt"] == 1 and block[0]["fault_rank"] == 1


def test_an_attempt_restarted_near_the_end_keeps_one_timed_step(tmp_path):
    """train.warmup_steps=1 and a checkpoint after step 2 of 3: a manual resume is refused (no timed
    step), but a restarted resume=auto attempt must finish the job, so it times its last step."""
    run_dir = tmp_path / "run"
    settings = ["model=tiny", "train.steps=3", "train.warmup_steps=1", "train.resume=auto", f"run.dir={run_dir}"]
    _checkpoint(run_dir / "checkpoints", 2, plan_for(1, *settings))
    plan = plan_for(1, *settings)
    assert (plan.start_step, plan.warmup_steps) == (2, 0)
    with pytest.raises(CheckpointError, match="leaves no timed step"):
        plan_for(1, "model=tiny", "train.steps=3", "train.warmup_steps=1",
                 f"train.resume={run_dir / 'checkpoints' / 'step_000002'}")


# -- the attempt's number ------------------------------------------------------------------------
@pytest.mark.parametrize("started,restart_count,expected", [
    (2, "0", 2),  # a Slurm requeue or a fresh node agent: torchrun counts from 0 again, the journal does not
    (0, "1", 1),  # attempt 0 died in its set-up, before `started`: torchrun's count keeps it from repeating
    (1, "1", 1),
])
def test_an_attempt_is_numbered_by_the_journal_and_never_below_torchruns_count(tmp_path, started, restart_count,
                                                                               expected):
    for attempt in range(started):
        Journal(tmp_path, rank=0, attempt=attempt).append(STARTED)
    assert attempt_number(str(tmp_path), {"TORCHELASTIC_RESTART_COUNT": restart_count}) == expected
    assert attempt_number(None, {"TORCHELASTIC_RESTART_COUNT": restart_count}) == int(restart_count)
