"""What starting a Chroma server costs: the `chroma` script (which imports the chromadb package
before it calls the Rust CLI) against the command `ensure_services` runs (`services.chroma_command`,
the Rust CLI called directly), each started on an empty directory until its heartbeat answers,
then ended.

    .venv/bin/python -m benchmarks.chroma_start [--rounds 5]

Prints, for each command, the median seconds to the first heartbeat and the median CPU-seconds of
the server's process (its start, then its SIGTERM), then the direct command's ratios to the script's.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from memory_pipelines.lib.infra.services import (
    chroma_binary,
    chroma_command,
    chroma_heartbeat,
    chroma_run_command,
    free_port,
)

START_SECONDS = 60.0


def start_once(command: list[str], path: Path) -> tuple[float, float]:
    """Seconds to the first heartbeat and the CPU-seconds the server used, start to exit."""
    port = free_port()
    started = time.monotonic()
    proc = subprocess.Popen(
        chroma_run_command(path, port, command=command),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "RUST_LOG": "warn"},
    )
    try:
        while not chroma_heartbeat(f"http://127.0.0.1:{port}", timeout=1.0):
            if proc.poll() is not None or time.monotonic() > started + START_SECONDS:
                raise RuntimeError(f"{command[0]} did not start a server")
            time.sleep(0.02)
        answered = time.monotonic() - started
    finally:
        proc.send_signal(signal.SIGTERM)
    _, _, usage = os.wait4(proc.pid, 0)
    proc.returncode = 0  # reaped here: Popen must not wait for it again
    return answered, usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    commands = {"chroma script": [str(chroma_binary())], "chroma_command()": chroma_command()}
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in commands}
    with tempfile.TemporaryDirectory(prefix="chroma-start-") as scratch:
        for round_ in range(args.rounds):
            for which, (name, command) in enumerate(commands.items()):  # interleaved: both see the same machine
                results[name].append(start_once(command, Path(scratch) / f"{round_}-{which}"))
    medians = {}
    for name, rows in results.items():
        seconds, cpu = statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows)
        medians[name] = (seconds, cpu)
        print(f"{name:18} first heartbeat {seconds:5.2f} s   server CPU {cpu:5.2f} s   ({len(rows)} starts)")
    (base_s, base_cpu), (new_s, new_cpu) = medians["chroma script"], medians["chroma_command()"]
    print(f"chroma_command() / chroma script: time {new_s / base_s:.2f}x, CPU {new_cpu / base_cpu:.2f}x")


if __name__ == "__main__":
    main()
