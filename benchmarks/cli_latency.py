"""How long a CLI command takes on a HOME whose services run, against the same work in process.

    .venv/bin/python -m benchmarks.cli_latency [--repeat 5] [--home DIR]

On a 100-memory tenant, each round writes one memory and then times:
- `memory-pipelines materialize --tenant T` (a run through the instance: queue, the HOME's warm code
  server, run worker), and the same with a code server of its own started and awaited (`--verbose`
  does that, as every run did before the warm server), and the command in a process of its own
  (MEMORY_PIPELINES_WARM_COMMANDS=0) rather than forked from the warm server's command forker, with
  the machine's CPU-seconds of each;
- the baseline: a new Python process that runs the same job (`tenant_refresh`, in process) on the same
  instance with `execute_in_process`, from its start to its exit (what a script of yours pays);
- commands that run no job: `recall` (a new query each round, so never a cached answer), `recall
  --mode semantic`, `list`, `write`, `tenants` (target: each within 1.5 s).
Prints medians and ranges, and materialize / in process (target: within 2x). Before the rounds, the
first `materialize` of a HOME whose services run but whose code servers were ended: it starts the
warm code server, and is then forked from its command forker, or (MEMORY_PIPELINES_WARM_COMMANDS=0)
runs in its own process, which imports Dagster, as every first command did before; with the
machine's CPU-seconds of each.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.homes import discard, temporary_home
from memory_pipelines.launch.warm_commands import ENV_WARM_COMMANDS
from memory_pipelines.lib.infra import processes
from memory_pipelines.platform import MemoryPlatform

TENANT = "latency"
CLI = [sys.executable, "-m", "memory_pipelines.cli"]
IN_PROCESS = """
import sys
import dagster as dg
from memory_pipelines.definitions import defs
with dg.DagsterInstance.get() as instance:
    job = defs().resolve_job_def("tenant_refresh")
    tags = {"memory_pipelines/tenant": sys.argv[1]}
    result = job.execute_in_process(partition_key=sys.argv[1], instance=instance, tags=tags)
    assert result.success
"""


def machine_cpu() -> float:
    """CPU-seconds the whole machine has spent (/proc/stat): a command's own, its code server's,
    its run worker's and PostgreSQL's, on a machine that is otherwise quiet."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq = (int(value) for value in fields[:7])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


CPU: dict[str, list[float]] = {}


def timed(command: list[str], env: dict[str, str], label: str | None = None) -> float:
    start, cpu = time.perf_counter(), machine_cpu()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command[2:])} failed ({done.returncode}): {done.stderr[-2000:]}")
    if label is not None:
        CPU.setdefault(label, []).append(machine_cpu() - cpu)
    return seconds


def end_code_servers(home: Path) -> None:
    """End HOME's code servers (their fork servers and command forkers with them); its services stay."""
    servers = [proc for proc in processes.home_processes(home) if " api grpc " in " ".join(proc.args)]
    if not all(ended["ended"] for ended in processes.end_processes(servers)):
        raise SystemExit("the HOME's code servers did not end")
    time.sleep(1)  # their forkers notice within a second and take their links away


def line(label: str, values: list[float]) -> float:
    median = statistics.median(values)
    print(f"  {label:34} {median:6.2f} s  ({min(values):.2f}-{max(values):.2f}, n={len(values)})")
    return median


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--home", type=Path, help="data folder (default: a new temporary folder)")
    args = parser.parse_args()
    home = args.home or temporary_home("mp-bench-cli-")
    env = {**os.environ, "MEMORY_PIPELINES_HOME": str(home)}
    os.environ["MEMORY_PIPELINES_HOME"] = str(home)
    with MemoryPlatform.from_env() as platform:
        if TENANT not in {t["tenant_id"] for t in platform.tenants()}:
            platform.create_tenant(tenant_id=TENANT, sharing_mode="shared_pool")
            texts = [f"Note {i}: user {i % 10} flies to city {i % 17} on day {i % 28}." for i in range(100)]
            platform.write_many(
                tenant_id=TENANT, items=[{"user_id": f"u{i % 10}", "text": t} for i, t in enumerate(texts)]
            )
    dagster_env = dict(env)
    exported = subprocess.run([*CLI, "env"], env=env, capture_output=True, text=True, check=True).stdout
    for part in exported.split("\n"):
        if part.startswith("export "):
            name, _, value = part.removeprefix("export ").partition("=")
            dagster_env[name] = value.strip("'\"")

    def write(n: int) -> list[str]:
        return [*CLI, "write", "--tenant", TENANT, "--user", "u1", f"Round {n}: u1 booked a train to Porto."]

    timed(write(0), env)
    # The same command in a process of its own, which imports Dagster: how every command ran before.
    # Its variable is part of a code server's identity: it has warm servers of its own.
    own_process = {**env, ENV_WARM_COMMANDS: "0"}
    figures: dict[str, list[float]] = {}
    for n in range(1, args.repeat + 1):
        for label, first_env in (("first materialize", env), ("first materialize, not forked", own_process)):
            timed(write(n + 5000), env)
            end_code_servers(home)
            command = [*CLI, "materialize", "--tenant", TENANT]
            figures.setdefault(label, []).append(timed(command, first_env, label))
    for warm_env in (env, own_process):  # each environment's warm server, before the rounds
        timed([*CLI, "materialize", "--tenant", TENANT], warm_env)
    for n in range(1, args.repeat + 1):
        timed(write(n), env)
        label = "materialize (CLI)"
        figures.setdefault(label, []).append(timed([*CLI, "materialize", "--tenant", TENANT], env, label))
        timed(write(n + 4000), env)
        label = "materialize (CLI, not forked warm)"
        figures.setdefault(label, []).append(timed([*CLI, "materialize", "--tenant", TENANT], own_process, label))
        timed(write(n + 3000), env)
        # --verbose runs its own code server (the event log goes to its stderr): how every run went before.
        own = [*CLI, "--verbose", "materialize", "--tenant", TENANT]
        figures.setdefault("materialize (CLI, own code server)", []).append(timed(own, env))
        timed(write(n + 1000), env)
        baseline = [sys.executable, "-c", IN_PROCESS, TENANT]
        figures.setdefault("materialize (in process)", []).append(timed(baseline, dagster_env))
        recall = [*CLI, "recall", "--tenant", TENANT, "--user", "u1"]
        figures.setdefault("recall (hybrid, uncached)", []).append(timed([*recall, f"train to city {n}"], env))
        semantic = [*recall, "--mode", "semantic", f"flights on day {n}"]
        figures.setdefault("recall --mode semantic", []).append(timed(semantic, env))
        figures.setdefault("list", []).append(timed([*CLI, "list", "--tenant", TENANT, "--user", "u1"], env))
        figures.setdefault("write", []).append(timed(write(n + 2000), env))
        figures.setdefault("tenants", []).append(timed([*CLI, "tenants"], env))

    print(f"HOME {home}, tenant of about {100 + 3 * args.repeat} memories, services running")
    medians = {label: line(label, values) for label, values in figures.items()}
    print("machine CPU-seconds per command (all its processes; a quiet machine):")
    for label, values in CPU.items():
        line(label, values)
    first, first_alone, forked, alone = (statistics.median(CPU[label]) for label in CPU)
    print(f"first materialize forked / in its own process, machine CPU: {first / first_alone:.2f}x")
    print(f"materialize forked warm / in its own process, machine CPU: {forked / alone:.2f}x")
    ratio = medians["materialize (CLI)"] / medians["materialize (in process)"]
    print(f"materialize CLI / in process: {ratio:.2f}x (target within 2x: {'met' if ratio <= 2 else 'MISSED'})")
    slow = [
        label
        for label in ("recall (hybrid, uncached)", "recall --mode semantic", "list", "write", "tenants")
        if medians[label] > 1.5
    ]
    print(f"commands without a job within 1.5 s: {'met' if not slow else 'MISSED: ' + ', '.join(slow)}")
    if args.home is None:
        discard(home)


if __name__ == "__main__":
    main()
