"""Static checks of the reference deployment: ``docker/compose.yml`` and ``docker/bin/*.sh``.

No Docker engine runs here, so the compose file is parsed with PyYAML and held against the
repository: the start scripts it names exist and are strict-mode bash, every service has a
health check, every variable is documented, no secret is written into the file.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKER_DIR = ROOT / "docker"
COMPOSE_FILE = DOCKER_DIR / "compose.yml"
DOCKERFILE = DOCKER_DIR / "Dockerfile"
SCRIPTS = sorted((DOCKER_DIR / "bin").glob("*.sh"))
DOCS = (ROOT / "README.md", ROOT / "docs" / "production.md")

WORKERS = ("worker-1", "worker-2")
BEATS = ("beat-1", "beat-2")
#: Services built from docker/Dockerfile; the others use the official images.
APP_SERVICES = ("migrate", "web", *WORKERS, *BEATS, "flower")
#: Services that use the database and so must wait for the migrations.
DATABASE_SERVICES = ("web", *WORKERS, *BEATS)
#: Variables whose values are secrets: never a literal, never a default.
SECRET_NAME = re.compile(r"SECRET|PASSWORD|BASIC_AUTH")
#: ``$VAR``, ``${VAR}``, ``${VAR:-default}``, ``${VAR:?message}``, and ``$$VAR`` (the container's shell).
VARIABLE_REFERENCE = re.compile(r"\$\$?\{?([A-Za-z_][A-Za-z0-9_]*)")


def load_compose() -> dict[str, Any]:
    with COMPOSE_FILE.open() as stream:
        document = yaml.safe_load(stream)
    assert isinstance(document, dict)
    return document


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load_compose()


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return compose["services"]


def dockerfile_workdir() -> str:
    workdirs = re.findall(r"^WORKDIR\s+(\S+)", DOCKERFILE.read_text(), flags=re.MULTILINE)
    assert workdirs, "docker/Dockerfile sets no WORKDIR"
    return workdirs[-1].rstrip("/")


def script_in_repository(container_path: str) -> Path:
    """The repository file behind a path in the image (the Dockerfile copies the tree to WORKDIR)."""
    workdir = dockerfile_workdir()
    assert container_path.startswith(workdir + "/"), f"{container_path} is not under the image's {workdir}"
    return ROOT / container_path.removeprefix(workdir + "/")


def start_script(service: dict[str, Any]) -> Path:
    command = service["command"]
    assert isinstance(command, list) and len(command) == 1, f"expected one start script, got {command!r}"
    return script_in_repository(command[0])


def logical_lines(path: Path) -> list[str]:
    """Non-blank, non-comment lines, with backslash continuations joined."""
    joined = path.read_text().replace("\\\n", " ")
    return [line.strip() for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def health_test(service: dict[str, Any]) -> list[str]:
    test = service["healthcheck"]["test"]
    assert isinstance(test, list) and test[0] in {"CMD", "CMD-SHELL"}, test
    return test


def documented_names() -> set[str]:
    return {name for doc in DOCS for name in re.findall(r"`([A-Z][A-Z0-9_]*)`", doc.read_text())}


# --- services --------------------------------------------------------------------------------


def test_compose_defines_the_reference_services(services):
    assert set(services) == {"postgres", "redis", *APP_SERVICES}


def test_two_workers_and_two_beats_run_with_distinct_node_names(services):
    assert [start_script(services[name]).name for name in WORKERS] == ["worker.sh", "worker.sh"]
    assert [start_script(services[name]).name for name in BEATS] == ["beat.sh", "beat.sh"]
    # The node name (celery@<hostname>) tells the ledger which node owns an attempt: two live
    # workers sharing one would judge each other's pool processes dead.
    hostnames = [services[name].get("hostname") for name in (*WORKERS, *BEATS)]
    assert None not in hostnames
    assert len(set(hostnames)) == len(hostnames)
    assert all("replicas" not in services[name].get("deploy", {}) for name in (*WORKERS, *BEATS))


def test_images_are_postgresql_15_or_16_and_redis_7(services):
    assert re.fullmatch(r"postgres:1[56](\.\d+)*(-\S+)?", services["postgres"]["image"])
    assert re.fullmatch(r"redis:7(\.\d+)*(-\S+)?", services["redis"]["image"])


def test_application_services_are_built_from_the_repository_dockerfile(services):
    for name in APP_SERVICES:
        build = services[name]["build"]
        context = (DOCKER_DIR / build["context"]).resolve()
        assert context == ROOT, name
        assert (context / build["dockerfile"]).resolve() == DOCKERFILE, name
    assert {services[name]["image"] for name in APP_SERVICES} == {services["web"]["image"]}


def test_the_image_contains_the_start_scripts():
    dockerfile = DOCKERFILE.read_text()
    assert re.search(r"^COPY\s+\.\s+\.", dockerfile, flags=re.MULTILINE), "the Dockerfile no longer copies the tree"
    ignored = [line.strip().rstrip("/") for line in (ROOT / ".dockerignore").read_text().splitlines()]
    assert not {"docker", "docker/bin", "bin", "*.sh", "**/*.sh"} & set(ignored)


def test_application_services_run_production_settings(services):
    for name in APP_SERVICES:
        assert services[name]["environment"]["DJANGO_SETTINGS_MODULE"] == "config.settings.production", name


def test_database_users_wait_for_migrations_and_healthy_services(services):
    for name in (*DATABASE_SERVICES, "migrate"):
        depends_on = services[name]["depends_on"]
        assert depends_on["postgres"] == {"condition": "service_healthy"}, name
        assert depends_on["redis"] == {"condition": "service_healthy"}, name
    for name in DATABASE_SERVICES:
        assert services[name]["depends_on"]["migrate"] == {"condition": "service_completed_successfully"}, name
    assert services["flower"]["depends_on"] == {"redis": {"condition": "service_healthy"}}


def test_migrations_run_once_in_a_one_shot_service(services):
    migrate = services["migrate"]
    assert migrate["restart"] == "no"
    assert logical_lines(start_script(migrate))[-1] == "exec python manage.py migrate --noinput"
    migrating = {path.name for path in SCRIPTS if any("manage.py migrate" in line for line in logical_lines(path))}
    assert migrating == {"migrate.sh"}, "only the one-shot service may migrate (concurrent migrations race)"


def test_web_and_flower_are_published_on_loopback_only(services):
    for name in ("web", "flower"):
        for port in services[name]["ports"]:
            assert port.startswith("127.0.0.1:"), f"{name} publishes {port!r} beyond the host"
    for name in set(services) - {"web", "flower"}:
        assert "ports" not in services[name], f"{name} should not be published"


# --- start scripts ---------------------------------------------------------------------------


def test_every_application_service_runs_an_executable_script_from_docker_bin(services):
    used = set()
    for name in APP_SERVICES:
        script = start_script(services[name])
        assert script.parent == DOCKER_DIR / "bin", name
        assert script.is_file(), f"{name}: {script} does not exist"
        assert script.stat().st_mode & 0o111, f"{name}: {script} is not executable"
        used.add(script)
    assert used == set(SCRIPTS), "a script in docker/bin is unused, or a service runs one from elsewhere"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: path.name)
def test_start_script_is_strict_mode_bash_ending_in_exec(script):
    lines = script.read_text().splitlines()
    assert lines[0] == "#!/usr/bin/env bash"
    assert logical_lines(script)[0] == "set -euo pipefail"
    last = logical_lines(script)[-1]
    assert last.startswith("exec "), f"{script.name} ends in {last!r}, not in an exec"
    assert script.stat().st_mode & 0o111


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: path.name)
def test_start_script_passes_bash_syntax_check(script):
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr


def test_each_start_script_execs_its_process(services):
    def last_line(name: str) -> str:
        return logical_lines(start_script(services[name]))[-1]

    assert last_line("web").startswith("exec gunicorn config.wsgi:application ")
    assert re.match(r"exec celery -A config worker\b", last_line("worker-1"))
    assert re.match(r"exec celery -A config beat -S taskplatform\.beat\.LockedScheduler\b", last_line("beat-1"))
    assert last_line("flower") == "exec bin/flower"
    assert (ROOT / "bin" / "flower").stat().st_mode & 0o111


# --- health checks ---------------------------------------------------------------------------


def test_every_service_has_a_health_check_and_only_the_one_shot_disables_it(services):
    for name, service in services.items():
        assert "healthcheck" in service, f"{name} has no healthcheck"
        if service["healthcheck"].get("disable"):
            assert name == "migrate", f"{name} disables its healthcheck but is not the one-shot migration"
        else:
            health_test(service)


def test_health_checks_probe_what_each_process_serves(services):
    def joined(name: str) -> str:
        return " ".join(health_test(services[name])[1:])

    assert joined("postgres").startswith("pg_isready ")
    assert joined("redis").startswith("redis-cli ping")
    assert "urllib" in joined("web") and "http://127.0.0.1:8000/admin/login/" in joined("web")
    for name in WORKERS:
        assert "celery -A config inspect ping --destination celery@$$HOSTNAME" in joined(name)
    for name in BEATS:
        assert joined(name).startswith("python manage.py taskplatform status --json |")
    assert "urllib" in joined("flower") and "http://127.0.0.1:5555/healthcheck" in joined("flower")


def test_health_check_commands_are_valid_shell_and_python(services):
    for name, service in services.items():
        if service["healthcheck"].get("disable"):
            continue
        test = [part.replace("$$", "$") for part in health_test(service)]  # what the container sees
        if test[0] == "CMD-SHELL":
            result = subprocess.run(["sh", "-n", "-c", test[1]], capture_output=True, text=True, check=False)
            assert result.returncode == 0, f"{name}: {result.stderr}"
            programs = re.findall(r"python -c '([^']*)'", test[1])
        else:
            programs = [test[test.index("-c") + 1]] if "-c" in test else []
        for program in programs:
            compile(program, f"<{name} healthcheck>", "exec")


# --- environment -----------------------------------------------------------------------------


def referenced_variables() -> dict[str, set[str]]:
    """Every variable the compose file and the start scripts read or set, by file."""
    found: dict[str, set[str]] = {}
    for path in (COMPOSE_FILE, *SCRIPTS):
        found[path.name] = set(VARIABLE_REFERENCE.findall(path.read_text()))
    for service in load_compose()["services"].values():
        found[COMPOSE_FILE.name] |= set(service.get("environment") or {})
    return found


def test_every_variable_in_compose_and_scripts_is_documented():
    documented = documented_names()
    missing = {f"{name} ({file})" for file, names in referenced_variables().items() for name in names - documented}
    assert not missing, f"not documented in README.md or docs/production.md: {sorted(missing)}"


def test_secrets_are_required_interpolations_never_literals(services):
    text = COMPOSE_FILE.read_text()
    for match in re.finditer(r"\$\{([A-Za-z_][A-Za-z0-9_]*)([^}]*)\}", text):
        name, modifier = match.groups()
        if SECRET_NAME.search(name):
            assert modifier.startswith(":?"), f"${{{name}{modifier}}}: a secret needs ':?', not a default"
    for service_name, service in services.items():
        for key, value in (service.get("environment") or {}).items():
            if SECRET_NAME.search(key):
                assert re.fullmatch(rf"\$\{{{key}:\?[^}}]+\}}", str(value)), f"{service_name}: {key}={value!r}"


def test_passwords_in_urls_are_interpolated(services):
    for service_name, service in services.items():
        for key, value in (service.get("environment") or {}).items():
            credentials = re.search(r"://[^/@\s]*?:([^@\s]*)@", str(value or ""))
            if credentials:
                password = credentials.group(1)
                assert re.fullmatch(r"\$\{[A-Z_]*PASSWORD:\?[^}]+\}", password), f"{service_name}: {key}"


def test_flower_requires_basic_auth(services):
    assert services["flower"]["environment"]["FLOWER_BASIC_AUTH"].startswith("${FLOWER_BASIC_AUTH:?")
    assert 'if [ -z "${FLOWER_BASIC_AUTH:-}" ] && [ -z "${FLOWER_AUTH:-}" ]' in (ROOT / "bin" / "flower").read_text()
