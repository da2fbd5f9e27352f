"""Start a real Prometheus (Debian package) on a free loopback port, with a deadline, and kill it by pid.

Usage::

    with running_prometheus(tmp_path, targets=["127.0.0.1:8321"], rules=fast_rules()) as prom:
        alert = prom.wait_for_alert("DDPJobHang", state="firing", labels={"job": "j1"}, timeout_s=60)

``fast_rules`` derives fast rules from ``deploy/alerts.yml`` (same expressions, short ``for``) so the
end-to-end test checks the shipped rules instead of a copy of them.
"""

from __future__ import annotations

import contextlib
import copy
import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tests.support.procs import free_port, kill_group

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"


def deploy_rules() -> dict[str, Any]:
    """deploy/alerts.yml as a dict."""
    return dict(yaml.safe_load((DEPLOY / "alerts.yml").read_text()))


def fast_rules(for_s: str = "1s") -> dict[str, Any]:
    """deploy/alerts.yml with every ``for`` shortened to ``for_s``; expressions untouched."""
    doc = copy.deepcopy(deploy_rules())
    for group in doc["groups"]:
        group["interval"] = "1s"
        for rule in group["rules"]:
            if "alert" in rule:
                rule["for"] = for_s
    return doc


@dataclass
class Prometheus:
    url: str
    proc: subprocess.Popen[str]
    log_path: Path

    def get(self, path: str, **params: str) -> Any:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        with urllib.request.urlopen(f"{self.url}{path}{query}", timeout=5) as resp:
            body = json.loads(resp.read())
        if body.get("status") != "success":
            raise RuntimeError(f"Prometheus {path}: {body}")
        return body["data"]

    def alerts(self) -> list[dict[str, Any]]:
        return list(self.get("/api/v1/alerts")["alerts"])

    def query(self, expr: str) -> list[dict[str, Any]]:
        return list(self.get("/api/v1/query", query=expr)["result"])

    def targets_up(self) -> bool:
        active = self.get("/api/v1/targets")["activeTargets"]
        return bool(active) and all(t.get("health") == "up" for t in active)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def wait_for_alert(
        self,
        name: str,
        *,
        state: str = "firing",
        labels: Mapping[str, str] | None = None,
        timeout_s: float = 60,
    ) -> dict[str, Any]:
        """Poll /api/v1/alerts until ``name`` is in ``state`` with ``labels``; raise with context on timeout."""
        deadline = time.monotonic() + timeout_s
        seen: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            seen = self.alerts()
            for alert in seen:
                if alert["labels"].get("alertname") != name or alert.get("state") != state:
                    continue
                if all(alert["labels"].get(k) == v for k, v in (labels or {}).items()):
                    return alert
            if self.proc.poll() is not None:
                break
            time.sleep(0.5)
        raise AssertionError(
            f"no {state} {name} {dict(labels or {})} within {timeout_s} s; alerts: {seen}\n{self.log()}"
        )


def write_config(
    directory: Path, targets: Sequence[str], rules: Mapping[str, Any] | None, *, interval_s: float = 1.0
) -> Path:
    """A prometheus.yml derived from deploy/prometheus.yml: local targets, fast scrapes, the given rules."""
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    config["global"] = {"scrape_interval": f"{interval_s:g}s", "evaluation_interval": f"{interval_s:g}s"}
    config.pop("alerting", None)  # no Alertmanager here: alerts are read from Prometheus' own API
    config["rule_files"] = []
    if rules is not None:
        (directory / "rules.yml").write_text(yaml.safe_dump(dict(rules)))
        config["rule_files"] = [str(directory / "rules.yml")]
    (scrape,) = config["scrape_configs"]
    scrape["static_configs"] = [{"targets": list(targets)}]
    scrape["scrape_interval"] = f"{interval_s:g}s"
    path = directory / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    return path


@contextlib.contextmanager
def running_prometheus(
    directory: Path,
    *,
    targets: Sequence[str],
    rules: Mapping[str, Any] | None = None,
    ready_timeout_s: float = 30,
) -> Iterator[Prometheus]:
    """Run Prometheus with a temp config and data dir under ``directory``; killed by pid on exit."""
    directory.mkdir(parents=True, exist_ok=True)
    config = write_config(directory, targets, rules)
    port = free_port()
    log_path = directory / "prometheus.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={config}",
                f"--storage.tsdb.path={directory / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
    prom = Prometheus(f"http://127.0.0.1:{port}", proc, log_path)
    try:
        _wait_ready(prom, ready_timeout_s)
        yield prom
    finally:
        kill_group(proc)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)


def _wait_ready(prom: Prometheus, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if prom.proc.poll() is not None:
            raise RuntimeError(f"prometheus exited with {prom.proc.returncode}:\n{prom.log()}")
        with contextlib.suppress(OSError), urllib.request.urlopen(f"{prom.url}/-/ready", timeout=2) as resp:
            if resp.status == 200:
                return
        time.sleep(0.2)
    raise RuntimeError(f"prometheus not ready within {timeout_s} s:\n{prom.log()}")
