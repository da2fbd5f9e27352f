"""Configuration: explicit argument > DDPSCOPE_* env > default; bad env warns, bad argument raises."""

from __future__ import annotations

import logging

import pytest

from ddpscope.agent.config import MIN_HANG_TIMEOUT_S, Config, default_job_id


def test_defaults_match_the_design_table() -> None:
    cfg = Config.from_env({"DDPSCOPE_JOB": "j"})
    assert cfg.url == "http://127.0.0.1:8321" and cfg.token is None
    assert cfg.hang_timeout_s == 300.0 and cfg.heartbeat_s == 2.0 and not cfg.disabled
    assert cfg.spool_dir.endswith("/j") and "ddpscope-" in cfg.spool_dir
    assert cfg.rank is None and cfg.ingest_url == "http://127.0.0.1:8321/api/v1/ingest"


def test_environment_variables_are_read() -> None:
    env = {
        "DDPSCOPE_URL": "http://collector:9000/",
        "DDPSCOPE_JOB": "run-7",
        "DDPSCOPE_TOKEN": "t",
        "DDPSCOPE_SPOOL_DIR": "/var/spool/x",
        "DDPSCOPE_HANG_TIMEOUT": "60",
        "DDPSCOPE_HEARTBEAT_S": "0.5",
        "DDPSCOPE_DISABLED": "1",
        "DDPSCOPE_QUEUE_SIZE": "10",
        "DDPSCOPE_SPOOL_MAX_MB": "2",
        "RANK": "3",
    }
    cfg = Config.from_env(env)
    assert (cfg.url, cfg.job, cfg.token, cfg.spool_dir) == (
        "http://collector:9000/",
        "run-7",
        "t",
        "/var/spool/x",
    )
    assert (cfg.hang_timeout_s, cfg.heartbeat_s, cfg.disabled, cfg.max_queue) == (60.0, 0.5, True, 10)
    assert cfg.spool_max_bytes == 2 * 2**20 and cfg.rank == 3
    assert cfg.ingest_url == "http://collector:9000/api/v1/ingest"


def test_an_explicit_argument_beats_the_environment() -> None:
    cfg = Config.from_env(
        {"DDPSCOPE_JOB": "env", "DDPSCOPE_HANG_TIMEOUT": "60"}, job="arg", hang_timeout_s=5.0
    )
    assert cfg.job == "arg" and cfg.hang_timeout_s == 5.0


@pytest.mark.parametrize(
    ("name", "value", "field", "default"),
    [
        ("DDPSCOPE_HANG_TIMEOUT", "soon", "hang_timeout_s", 300.0),
        ("DDPSCOPE_HANG_TIMEOUT", "-5", "hang_timeout_s", 300.0),
        ("DDPSCOPE_HEARTBEAT_S", "0", "heartbeat_s", 2.0),
        ("DDPSCOPE_DISABLED", "maybe", "disabled", False),
        ("DDPSCOPE_URL", "collector:8321", "url", "http://127.0.0.1:8321"),
        ("DDPSCOPE_QUEUE_SIZE", "1.5", "max_queue", 100_000),
        # URLs the shipper's HTTP client cannot open: it died at start-up, its records left unsent.
        ("DDPSCOPE_URL", "http://[bad", "url", "http://127.0.0.1:8321"),
        ("DDPSCOPE_URL", "http://127.0.0.1:99999", "url", "http://127.0.0.1:8321"),
        ("DDPSCOPE_URL", "http://127.0.0.1:abc", "url", "http://127.0.0.1:8321"),
        ("DDPSCOPE_URL", "127.0.0.1:8400", "url", "http://127.0.0.1:8321"),
        # Below the spool's 4 KiB floor: every emit once raised (the agent could not be built).
        ("DDPSCOPE_SPOOL_MAX_MB", "0.001", "spool_max_bytes", 256 * 2**20),
    ],
)
def test_a_bad_environment_value_warns_and_falls_back_to_the_default(
    caplog, name, value, field, default
) -> None:
    with caplog.at_level(logging.WARNING, logger="ddpscope.agent.config"):
        cfg = Config.from_env({"DDPSCOPE_JOB": "j", name: value})
    assert getattr(cfg, field) == default
    assert name in caplog.text


def test_a_hang_timeout_under_a_second_is_raised_to_the_floor_with_a_warning(caplog) -> None:
    # 1e-3 was accepted: every step printed a hang report and its resolution.
    with caplog.at_level(logging.WARNING, logger="ddpscope.agent.config"):
        cfg = Config.from_env({"DDPSCOPE_JOB": "j", "DDPSCOPE_HANG_TIMEOUT": "1e-3"})
    assert cfg.hang_timeout_s == MIN_HANG_TIMEOUT_S == 1.0
    assert "DDPSCOPE_HANG_TIMEOUT=1e-3 is below the shortest hang timeout; using 1.0 s" in caplog.text
    with pytest.raises(ValueError, match="hang_timeout_s: must be at least 1.0 s"):
        Config(job="j", spool_dir="spool", hang_timeout_s=0.5)


def test_a_url_without_a_scheme_is_refused_with_what_a_url_must_look_like(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="ddpscope.agent.config"):
        Config.from_env({"DDPSCOPE_JOB": "j", "DDPSCOPE_URL": "collector:8321"})
    assert "it must be an http:// or https:// URL with a host and a valid port" in caplog.text


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("hang_timeout_s", 0),
        ("heartbeat_s", "2"),
        ("rank", -1),
        ("url", "ftp://x"),
        ("max_queue", 0),
        ("job", ""),
        ("disabled", "yes"),
        ("no_such_setting", 1),
    ],
)
def test_a_bad_explicit_argument_raises_a_value_error_naming_the_field(field, value) -> None:
    with pytest.raises(ValueError, match=field):
        Config.from_env({"DDPSCOPE_JOB": "j"}, **{field: value})


def test_ranks_of_one_launch_agree_on_a_generated_job_id_and_another_launch_differs() -> None:
    launch = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "WORLD_SIZE": "4"}
    ids = {default_job_id({**launch, "RANK": str(r)}) for r in range(4)}
    assert len(ids) == 1
    assert default_job_id({**launch, "MASTER_PORT": "29501"}) not in ids
    assert default_job_id({"TORCHELASTIC_RUN_ID": "elastic-1", **launch}) == "elastic-1"
    assert default_job_id({"TORCHELASTIC_RUN_ID": "none", **launch}) in ids  # torchrun's placeholder
    assert default_job_id({}) != default_job_id({})  # no launcher: random


def test_a_job_id_the_collector_cannot_store_or_route_is_refused_as_an_argument_and_ignored_from_the_environment():
    for bad in ("a" * 201, "team/run-1", "nul\x00"):
        with pytest.raises(ValueError, match="job"):
            Config.from_env({}, job=bad)
        assert Config.from_env({"DDPSCOPE_JOB": bad}).job != bad
    assert Config.from_env({"DDPSCOPE_JOB": "run-7"}).job == "run-7"
