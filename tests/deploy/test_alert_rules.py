"""deploy/: the alert rules pass their promtool unit tests, and the configs are what Prometheus accepts."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.system import STRICT

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
PROMTOOL = shutil.which("promtool")
ALERTS = {
    "DDPJobHang",
    "DDPStraggler",
    "DDPCollectiveMismatch",
    "DDPRankSilent",
    "DDPReplicasDiverged",
    "DDPMemoryGrowth",
}


def needs_promtool(test: Any) -> Any:
    """Runs promtool (Debian package prometheus): marked so `make test-fast` can leave it out."""
    skip = pytest.mark.skipif(
        PROMTOOL is None and not STRICT, reason="promtool (Debian package prometheus) not installed"
    )
    return pytest.mark.prometheus(skip(test))


def promtool(*args: str, cwd: Path = DEPLOY) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=60)


def rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load((DEPLOY / "alerts.yml").read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


@needs_promtool
def test_alert_rules_pass_their_promtool_unit_tests() -> None:
    result = promtool("test", "rules", "alerts_test.yml")
    assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
def test_the_unit_tests_catch_a_rule_that_waits_too_long(tmp_path: Path) -> None:
    # The same tests against a copy of the rules where DDPJobHang waits 5 minutes must fail,
    # so the promtool tests above do check the rules rather than pass whatever they contain.
    doc = yaml.safe_load((DEPLOY / "alerts.yml").read_text())
    for rule in doc["groups"][0]["rules"]:
        if rule["alert"] == "DDPJobHang":
            rule["for"] = "5m"
    (tmp_path / "alerts.yml").write_text(yaml.safe_dump(doc))
    shutil.copy(DEPLOY / "alerts_test.yml", tmp_path / "alerts_test.yml")
    result = promtool("test", "rules", "alerts_test.yml", cwd=tmp_path)
    assert result.returncode != 0
    assert "DDPJobHang" in result.stdout + result.stderr


@needs_promtool
@pytest.mark.parametrize("alert", ["DDPRankSilent", "DDPStraggler"])
def test_the_unit_tests_catch_a_rule_that_pages_for_a_rank_that_finished(tmp_path: Path, alert: str) -> None:
    # A finished job stays on /metrics for its retention with its ranks silent and their last
    # straggler flags: without the `unless ... ddpscope_rank_finished` clause these rules would page
    # for a job that is over, and the promtool tests must say so.
    doc = yaml.safe_load((DEPLOY / "alerts.yml").read_text())
    for rule in doc["groups"][0]["rules"]:
        if rule["alert"] == alert:
            assert "unless on (job, rank)" in rule["expr"]
            rule["expr"] = rule["expr"].split("unless")[0].strip()
    (tmp_path / "alerts.yml").write_text(yaml.safe_dump(doc))
    shutil.copy(DEPLOY / "alerts_test.yml", tmp_path / "alerts_test.yml")
    result = promtool("test", "rules", "alerts_test.yml", cwd=tmp_path)
    assert result.returncode != 0
    assert alert in result.stdout + result.stderr and "train-8" in result.stdout + result.stderr


@needs_promtool
def test_the_rules_and_the_prometheus_config_pass_promtool_checks() -> None:
    checked = promtool("check", "rules", "alerts.yml")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"{len(ALERTS)} rules found" in checked.stdout
    config = promtool("check", "config", "prometheus.yml")
    assert config.returncode == 0, config.stdout + config.stderr


def test_every_alert_names_the_training_job_and_where_to_look() -> None:
    found = rules()
    assert {r["alert"] for r in found} == ALERTS
    for rule in found:
        notes = rule["annotations"]
        assert "{{ $labels.job }}" in notes["summary"] and "{{ $labels.job }}" in notes["description"]
        assert "/api/v1/jobs/{{ $labels.job }}/" in notes["description"]
        if "rank" in rule["expr"].split("by (")[1].split(")")[0]:  # the per-rank alerts name the rank too
            assert "{{ $labels.rank }}" in notes["summary"]
        assert rule["labels"]["severity"] in {"page", "warning"}


def test_prometheus_scrapes_the_collector_and_keeps_the_training_jobs_label() -> None:
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    assert config["rule_files"] == ["alerts.yml"]
    (scrape,) = config["scrape_configs"]
    # Without honor_labels the collector's `job` label would become `exported_job`, and every alert
    # would name the scrape job instead of the training job.
    assert scrape["honor_labels"] is True
    assert scrape["static_configs"][0]["targets"] == ["collector:8321"]


def test_alertmanager_routes_to_a_declared_receiver_and_inhibits_only_known_alerts() -> None:
    config = yaml.safe_load((DEPLOY / "alertmanager.yml").read_text())
    receivers = {r["name"] for r in config["receivers"]}
    assert config["route"]["receiver"] in receivers
    assert "job" in config["route"]["group_by"]
    for rule in config["inhibit_rules"]:
        for matcher in rule["source_matchers"] + rule["target_matchers"]:
            name = matcher.split("=", 1)[1].strip('"')
            assert name in ALERTS
