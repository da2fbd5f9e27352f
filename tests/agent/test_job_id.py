"""Job ids: every rank of one job derives the same one, and the collector accepts whatever is derived."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from ddpscope.agent.config import Config, default_job_id, default_spool_dir, sanitized_job_id
from ddpscope.agent.records import MAX_JOB_LENGTH
from ddpscope.agent.transport import batch_body, encode_record, is_gzip
from ddpscope.server.body import decode_content
from ddpscope.server.codec import decode_batch
from tests.support.agent_env import ROOT

HOSTILE = [
    "bad/job",
    "team/exp/run 7",
    "nul\x00inside",
    "line\nbreak\tand\x1b[31mescape",
    "del\x7f and c1\x85",
    "latin1-\udce9t\udce9",  # bytes that were not UTF-8, as os.environ decodes them
    ".",
    "..",
    "x" * 500,
    "字" * 300,
    "😀" * 250,
]


def collector_accepts(job: str) -> bool:
    record = {"kind": "heartbeat", "job": job, "rank": 0, "stream": "s", "seq": 0, "time_ns": 1,
              "phase": "idle", "step": 0, "last_coll_seq": 0, "pid": 1}  # fmt: skip
    body = batch_body([encode_record(record)])
    (decoded,) = decode_batch(decode_content(body, "gzip" if is_gzip(body) else None, 1 << 20))
    return bool(decoded.job == job)


@pytest.mark.parametrize("bad", HOSTILE)
def test_an_invalid_job_id_becomes_a_valid_one_the_collector_accepts(bad: str) -> None:
    used = sanitized_job_id(bad)
    assert used != bad and 0 < len(used) <= MAX_JOB_LENGTH
    assert Config.from_env({}, job=used).job == used, "valid as an explicit argument too"
    assert collector_accepts(used)
    assert sanitized_job_id(used) == used, "a valid id is left alone"


def test_the_derived_id_stays_recognisable_and_long_ids_that_differ_at_the_end_stay_two_jobs() -> None:
    assert sanitized_job_id("bad/job") == "bad_job"
    assert sanitized_job_id("team/exp/run 7") == "team_exp_run 7"
    a, b = sanitized_job_id("x" * 300 + "-a"), sanitized_job_id("x" * 300 + "-b")
    assert a != b and a.startswith("x" * 150) and len(a) == len(b) == MAX_JOB_LENGTH


def test_an_invalid_job_id_from_the_environment_warns_naming_the_id_used(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="ddpscope.agent.config"):
        cfg = Config.from_env({"DDPSCOPE_JOB": "bad/job", "RANK": "1"})
    assert cfg.job == "bad_job"
    assert "DDPSCOPE_JOB='bad/job' is not a valid job id" in caplog.text and "using 'bad_job'" in caplog.text


def test_a_job_id_with_control_characters_is_refused_as_an_explicit_argument() -> None:
    for bad in ("a\nb", "esc\x1b[2J", "..", "\udce9"):
        with pytest.raises(ValueError, match="job"):
            Config.from_env({}, job=bad)


def test_ranks_with_different_parents_agree_on_the_id_derived_from_an_invalid_one() -> None:
    """The exploratory repro: each rank under its own `timeout`, so no common parent; the default
    id (which hashes the parent pid) would split the job in two."""
    code = "from ddpscope.agent.config import Config; print(Config.from_env().job)"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DDPSCOPE_", "TORCHELASTIC_", "SLURM_"))}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29400", WORLD_SIZE="2", PYTHONPATH=str(ROOT))

    def rank(r: int, job: str | None) -> tuple[str, str]:
        extra = {"RANK": str(r)} | ({"DDPSCOPE_JOB": job} if job is not None else {})
        # `sh -c '...; true'` forks: each rank's parent is its own shell.
        out = subprocess.run(
            ["sh", "-c", f'"{sys.executable}" -c "{code}"; true'],
            env=env | extra,
            capture_output=True,
            text=True,
            timeout=60,
        )
        return out.stdout.strip(), out.stderr

    (id0, err0), (id1, err1) = rank(0, "bad/job"), rank(1, "bad/job")
    assert id0 == id1 == "bad_job"
    assert "using 'bad_job'" in err0 and "using 'bad_job'" in err1
    assert rank(0, None)[0] != rank(1, None)[0], "why such launches must set DDPSCOPE_JOB"


def test_tasks_of_one_srun_step_agree_on_a_slurm_job_id_on_every_host() -> None:
    step = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "3", "SLURM_STEP_NUM_TASKS": "8"}
    node = {"MASTER_ADDR": "node-1", "MASTER_PORT": "29500", "WORLD_SIZE": "8"}
    assert default_job_id(step | node | {"RANK": "5"}) == "slurm-4242.3"
    # The parent pid plays no part: a task on another host has another one.
    assert default_job_id(step) == "slurm-4242.3"
    assert default_job_id(step | {"SLURM_STEP_ID": "4"}) != default_job_id(step), "every srun is a new job"
    assert default_job_id(step | {"TORCHELASTIC_RUN_ID": "elastic-9"}) == "elastic-9"
    # One task (`srun torchrun` on one node, `srun --pty bash`): one launcher, whose pid tells runs apart.
    single = step | node | {"SLURM_STEP_NUM_TASKS": "1"}
    assert default_job_id(single) == default_job_id(node) != "slurm-4242.3"


def test_a_torchrun_id_the_collector_cannot_store_is_made_valid_not_raised() -> None:
    assert default_job_id({"TORCHELASTIC_RUN_ID": "team/run-1"}) == "team_run-1"
    assert Config.from_env({"TORCHELASTIC_RUN_ID": "team/run-1"}).job == "team_run-1"


def test_the_default_spool_directory_name_fits_the_file_system_for_any_valid_job_id() -> None:
    for job in ("字" * MAX_JOB_LENGTH, "a" * MAX_JOB_LENGTH, "run-7"):
        name = os.path.basename(default_spool_dir(job))
        assert len(name.encode()) <= 255
    assert os.path.basename(default_spool_dir("run-7")) == "run-7"
    assert default_spool_dir("字" * 200) != default_spool_dir("字" * 199 + "x")
