"""What can be checked of the deployment without a Docker engine: the compose file's structure and
the files it mounts, and the collector image's entrypoint command, run as it is on this machine."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import tomllib
import yaml

from tests.support.procs import free_port, kill_group

ROOT = Path(__file__).resolve().parents[2]


def _dockerfile_instruction(name: str) -> list[str]:
    text = (ROOT / "Dockerfile").read_text()
    match = re.search(rf"^{name}\s+(\[.*\])\s*$", text, re.MULTILINE)
    assert match, f"Dockerfile has no exec-form {name}"
    return list(json.loads(match.group(1)))


def test_compose_runs_the_collector_prometheus_alertmanager_and_an_optional_postgres() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert set(services) == {"collector", "prometheus", "alertmanager", "postgres"}
    assert services["collector"]["build"] == "."
    assert services["postgres"]["profiles"] == ["postgres"]
    assert "postgres" not in services["prometheus"].get("depends_on", [])
    # Every file a service mounts from the repository exists; every named volume is declared.
    for name, service in services.items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (ROOT / source).is_file(), f"{name} mounts missing {source}"
            else:
                assert source in compose["volumes"], f"{name} uses undeclared volume {source}"
    # The collector listens on the port Prometheus scrapes.
    prometheus = yaml.safe_load((ROOT / "deploy/prometheus.yml").read_text())
    targets = [
        t for job in prometheus["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]
    ]
    assert "collector:8321" in targets
    assert "8321:8321" in services["collector"]["ports"]


def test_the_collector_image_installs_the_server_extra_without_torch() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert "--no-deps ." in text and "optional-dependencies']['server']" in text
    server_extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"][
        "server"
    ]
    assert not any(req.startswith("torch") for req in server_extra)
    for folder in ("agent", "ddp", "server", "dashboard", "cli"):
        assert f"COPY {folder} ./{folder}" in text


def test_the_image_entrypoint_command_serves_a_healthy_collector(tmp_path: Path) -> None:
    entrypoint = _dockerfile_instruction("ENTRYPOINT")
    cmd = _dockerfile_instruction("CMD")
    assert entrypoint[:2] == ["ddpscope", "serve"]
    port = free_port()
    # The image's command as it is, with the port and the data directory of this machine.
    argv = [shutil.which("ddpscope") or str(ROOT / ".venv/bin/ddpscope"), *entrypoint[1:], *cmd]
    argv[argv.index("8321")] = str(port)
    argv = [a.replace("sqlite:////data/", f"sqlite:///{tmp_path}/") for a in argv]
    proc = subprocess.Popen(
        argv, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as r:
                    assert r.status == 200
                    break
            except OSError:
                assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
                assert time.monotonic() < deadline, "collector did not become healthy in 30 s"
                time.sleep(0.2)
        assert (tmp_path / "ddpscope.db").exists()
    finally:
        kill_group(proc)
        proc.wait(timeout=10)


def test_a_public_host_without_a_token_refuses_to_start_unless_no_auth_is_given(tmp_path: Path) -> None:
    argv = [shutil.which("ddpscope") or str(ROOT / ".venv/bin/ddpscope"), "serve", "--host", "0.0.0.0"]
    out = subprocess.run(
        [*argv, "--port", str(free_port()), "--db", f"sqlite:///{tmp_path}/x.db"],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ),
    )
    assert out.returncode != 0
    assert "--token" in out.stderr and "--no-auth" in out.stderr
