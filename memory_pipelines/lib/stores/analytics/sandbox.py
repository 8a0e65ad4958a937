"""One analytics query in a process of its own, under limits the query cannot lift.

DuckDB's `memory_limit` bounds its buffer manager, not every allocation: `repeat('x', 2000000000)`
took 7.7 GB here under a 1 GB limit, and a scalar function need not check for interrupts. So the
query runs in a child process (`python -m` this module: about 0.3 s to start) whose data segment
is capped (RLIMIT_DATA: the limit plus what the child already holds), where such an allocation
fails inside DuckDB as an OutOfMemoryException, and whose wall clock the parent enforces by killing
it. The child holds one tenant's rows, handed to it
as Arrow IPC, and nothing else: no database connection, no key.
"""

from __future__ import annotations

import json
import math
import resource
import struct
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import date, datetime, time
from decimal import Decimal
from typing import Any, BinaryIO

import duckdb
import pyarrow as pa

from memory_pipelines.lib.infra.children import ISOLATED
from memory_pipelines.lib.infra.errors import ServiceError, ValidationError

__all__ = [
    "SLACK_MB",
    "Answer",
    "json_value",
    "run",
    "sandbox",
]

# What DuckDB and Python take beyond the buffer manager's share (hash tables' directories, result
# vectors, the rows being sent back), on top of `memory_mb`.
SLACK_MB = 256
_START_SECONDS = 10.0  # the child's start (Python, DuckDB and pyarrow), on top of the query's own time


@dataclass(frozen=True)
class Answer:
    columns: list[str]
    rows: list[list[Any]]
    truncated: bool


@contextmanager
def sandbox(table: pa.Table, *, memory_mb: int, threads: int) -> Iterator[duckdb.DuckDBPyConnection]:
    """A fresh in-memory DuckDB holding only `table` as `memories`, locked before any user SQL runs."""
    config: dict[str, str | bool | int | float | list[str]] = {
        "memory_limit": f"{memory_mb}MB",
        "threads": threads,
        # Python replacement scans would let SQL name any variable of the calling frames.
        "python_enable_replacements": False,
        "autoinstall_known_extensions": False,
        "autoload_known_extensions": False,
        "allow_community_extensions": False,
        # No spill files: an in-memory database would otherwise write `.tmp/` in the working directory.
        "temp_directory": "",
    }
    with duckdb.connect(":memory:", config=config) as con:
        con.register("memories", table)
        # Our own data is in; from here on nothing, the user's SQL included, can reach a file or
        # turn a setting back (SET and RESET fail once the configuration is locked).
        con.execute("SET enable_external_access = false")
        con.execute("SET lock_configuration = true")
        yield con


def run(table: pa.Table, sql: str, *, memory_mb: int, threads: int, timeout_seconds: float, max_rows: int) -> Answer:
    """Run `sql` (one SELECT, already checked) over `table` in a child process under the limits.

    Raises ServiceError naming `sql` when the query needs more memory or time than it may have,
    ValidationError naming `sql` for any other DuckDB error."""
    request = {"sql": sql, "memory_mb": memory_mb, "threads": threads, "max_rows": max_rows, "timeout": timeout_seconds}
    header = json.dumps(request).encode()
    payload = struct.pack(">I", len(header)) + header + _ipc(table)
    proc = subprocess.Popen(
        [sys.executable, ISOLATED, "-m", __name__],
        cwd="/",  # none of the caller's: it may be a directory others can write
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    try:
        out, _ = proc.communicate(payload, timeout=timeout_seconds + _START_SECONDS)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise _limit("time", memory_mb, timeout_seconds) from None
    except BrokenPipeError:
        out = b""
        proc.wait()
    try:
        answer = json.loads(out)
    except ValueError:
        # Killed by the kernel (an allocation outside DuckDB's reach) or crashed: the limit it met.
        raise _limit("memory", memory_mb, timeout_seconds, exit_code=proc.returncode) from None
    kind = answer.get("kind")
    if kind == "ok":
        return Answer(columns=answer["columns"], rows=answer["rows"], truncated=answer["truncated"])
    if kind in ("memory", "time"):
        raise _limit(kind, memory_mb, timeout_seconds)
    raise ValidationError("sql", str(answer.get("message")))


def _limit(what: str, memory_mb: int, timeout_seconds: float, exit_code: int | None = None) -> ServiceError:
    from memory_pipelines.lib.infra.settings import ENV_ANALYTICS_MEMORY_MB, ENV_ANALYTICS_TIMEOUT

    if what == "time":
        return ServiceError(
            "sql",
            f"stopped after {timeout_seconds:g} s, the limit of one analytics query ({ENV_ANALYTICS_TIMEOUT});"
            " narrow it, or raise the limit",
        )
    ended = f" (its process ended with code {exit_code})" if exit_code not in (None, 0) else ""
    return ServiceError(
        "sql",
        f"needs more than {memory_mb} MB, the limit of one analytics query ({ENV_ANALYTICS_MEMORY_MB}){ended};"
        " narrow it, or raise the limit",
    )


def _ipc(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return bytes(sink.getvalue().to_pybytes())


def _data_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    return 0


def _answer(stream: BinaryIO) -> dict[str, Any]:
    """In the child: read the query and the table, cap the data segment, run it under a timer."""
    (size,) = struct.unpack(">I", stream.read(4))
    request = json.loads(stream.read(size))
    table = pa.ipc.open_stream(stream.read()).read_all()
    memory_mb, max_rows = int(request["memory_mb"]), int(request["max_rows"])
    cap = _data_bytes() + (memory_mb + SLACK_MB) * 2**20
    resource.setrlimit(resource.RLIMIT_DATA, (cap, cap))
    try:
        with sandbox(table, memory_mb=memory_mb, threads=int(request["threads"])) as con:
            # DuckDB stops at its next check; the parent kills what never checks.
            timer = threading.Timer(float(request["timeout"]), con.interrupt)
            timer.start()
            try:
                statements = duckdb.extract_statements(request["sql"])
                if len(statements) != 1:  # the parent sends one; never run a second
                    return {"kind": "sql", "message": "must be exactly one SELECT statement"}
                cursor = con.execute(statements[0])
                columns = [d[0] for d in cursor.description or []]
                fetched = cursor.fetchmany(max_rows + 1)
            finally:
                timer.cancel()
        rows = [[json_value(v) for v in row] for row in fetched[:max_rows]]
        return {"kind": "ok", "columns": columns, "rows": rows, "truncated": len(fetched) > max_rows}
    except (duckdb.OutOfMemoryException, MemoryError):
        return {"kind": "memory"}
    except duckdb.InterruptException:
        return {"kind": "time"}
    except duckdb.Error as exc:
        return {"kind": "sql", "message": f"{type(exc).__name__}: {' '.join(str(exc).split())}"}


def json_value(value: Any) -> Any:
    """DuckDB's Python values as JSON: timestamps ISO 8601, decimals as numbers, bytes as hex."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, Decimal):
        return float(value) if value.is_finite() else str(value)
    if isinstance(value, (datetime, date, time)):
        return value.isoformat()
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).hex()
    if isinstance(value, dict):
        return {str(k): json_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_value(v) for v in value]
    return str(value)  # UUID, timedelta, ...


if __name__ == "__main__":
    sys.stdout.write(json.dumps(_answer(sys.stdin.buffer)))
