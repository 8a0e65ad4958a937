"""Every process's CPU time while a command runs, from the kernel's process accounting (acct(2)).

The suite's own figure (tests/support/cpu.py) counts a worker and the children it waited for; the
servers, code servers and run workers it did not wait for are missing. Process accounting writes a
record for every process that ends, short-lived ones included, so the sum is the work the machine
did. Needs root (CAP_SYS_PACCT); accounting is per machine, so other work meanwhile is counted too:

    sudo .venv/bin/python -m tests.support.process_cpu -- .venv/bin/pytest
"""

from __future__ import annotations

import argparse
import ctypes
import os
import struct
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

# struct acct_v3 (linux/acct.h): 64 bytes; times are comp_t (3-bit base-8 exponent, 13-bit
# mantissa) in AHZ (100) ticks.
_RECORD = 64
_HEAD = struct.Struct("<BBHIIIIIIfHH")
_AHZ = 100


def _comp(value: int) -> int:
    return (value & 0x1FFF) << (3 * (value >> 13))


def read(path: Path, since: float) -> list[tuple[str, float]]:
    """(command name, CPU-seconds) of each process recorded in `path` that started at `since` or later."""
    data = path.read_bytes()
    found = []
    for offset in range(0, len(data) - _RECORD + 1, _RECORD):
        record = data[offset : offset + _RECORD]
        fields = _HEAD.unpack(record[: _HEAD.size])
        if fields[1] != 3:  # ac_version: only v3 records have this layout
            continue
        began, utime, stime = fields[8], fields[10], fields[11]
        if began + 1 >= since:
            name = record[48:64].split(b"\0")[0].decode(errors="replace")
            found.append((name, (_comp(utime) + _comp(stime)) / _AHZ))
    return found


def _acct(path: Path | None) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.acct(None if path is None else os.fsencode(path)) != 0:
        state = "off" if path is None else "on"
        raise SystemExit(f"process accounting could not be switched {state}: {os.strerror(ctypes.get_errno())}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.support.process_cpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("command", nargs="+", help="the command to run (after --)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        log = Path(scratch) / "pacct"
        log.touch(mode=0o600)
        started, wall = time.time(), time.monotonic()
        _acct(log)
        try:
            code = subprocess.run(args.command, check=False).returncode
        finally:
            _acct(None)
        wall = time.monotonic() - wall
        records = read(log, started)
    by_name: defaultdict[str, float] = defaultdict(float)
    count: Counter[str] = Counter()
    for name, cpu in records:
        by_name[name] += cpu
        count[name] += 1
    total = sum(by_name.values())
    available = wall * (os.cpu_count() or 1)
    print(f"{total:,.0f} CPU-seconds in {len(records):,} processes, {wall:,.0f} s of wall time", file=sys.stderr)
    print(f"{total / available:.0%} of the {available:,.0f} CPU-seconds the cores had", file=sys.stderr)
    for name, cpu in sorted(by_name.items(), key=lambda item: -item[1])[:15]:
        print(f"{cpu:10.1f} {count[name]:8d}  {name}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
