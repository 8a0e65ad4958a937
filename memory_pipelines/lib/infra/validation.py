"""Validation of every caller-supplied field, before anything is written."""

from __future__ import annotations

import contextvars
import math
import re
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from memory_pipelines.lib.infra.errors import ValidationError

__all__ = [
    "MAX_K",
    "MAX_TEXT_BYTES",
    "MAX_VERSION",
    "RECALL_MODES",
    "RESERVED_TENANT_IDS",
    "RESERVED_TENANT_PREFIXES",
    "SHARING_MODES",
    "check_bool",
    "check_category",
    "check_confidence",
    "check_customer_tenant",
    "check_id",
    "check_items",
    "check_memory_id",
    "check_new_tenant",
    "check_optional_bool",
    "check_optional_id",
    "check_optional_str",
    "check_optional_text",
    "check_recall",
    "check_sharing_mode",
    "check_text",
    "check_utf8",
    "check_version",
    "is_reserved_tenant",
    "new_memory_id",
    "platform_owned",
]

MAX_TEXT_BYTES = 64 * 1024
# Versions are PostgreSQL `integer` columns.
MAX_VERSION = 2**31 - 1
# Ids are opaque, stable keys; never names or e-mail addresses (DESIGN section 5).
_ID_RE = re.compile(r"(?!.*--)[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_MEMORY_ID_RE = re.compile(r"m_[0-9a-f]{32}")
_CATEGORY_RE = re.compile(r"[a-z][a-z0-9_]{0,31}")
SHARING_MODES = ("strict", "shared_pool", "progressive")


def check_utf8(field: str, value: str) -> str:
    """`value` if it can be stored as UTF-8.

    Python decodes command-line arguments (and stdin in a C locale) with `surrogateescape`: bytes
    that are not UTF-8 arrive as lone surrogates and would only fail later, in `.encode()` or in
    the database driver, as a traceback after some work was done. Refused here, naming the field.
    """
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValidationError(field, f"is not valid UTF-8 ({_describe_bad_char(value, exc.start)})") from None
    return value


def _describe_bad_char(value: str, index: int) -> str:
    code = ord(value[index])
    if 0xDC80 <= code <= 0xDCFF:  # surrogateescape's encoding of one undecodable byte
        return f"undecodable byte 0x{code - 0xDC00:02x} at character {index}"
    return f"lone surrogate U+{code:04X} at character {index}"


def check_id(field: str, value: object) -> str:
    """Return `value` if it is a well-formed tenant, user or team id."""
    if not isinstance(value, str) or not value:
        raise ValidationError(field, "is required")
    check_utf8(field, value)
    if not _ID_RE.fullmatch(value):
        raise ValidationError(
            field,
            "must be 1-64 characters of letters, digits, '_', '.', '-' starting with a letter or digit"
            " (no SQL comment marker '--')",
        )
    return value


# Tenants the platform owns: the monthly evaluation's (`eval`, `eval-*`) and the canary drill's
# (`canary-*`), matched exactly as the sensors always have (`Eval` is a customer's). No customer
# door accepts them and the store creates them only for the platform's own code, so a sensor or
# schedule that skips them skips no customer.
RESERVED_TENANT_IDS = frozenset({"eval"})
RESERVED_TENANT_PREFIXES = ("canary-", "eval-")
_PLATFORM_OWNED: contextvars.ContextVar[bool] = contextvars.ContextVar("platform_owned", default=False)


def is_reserved_tenant(tenant_id: str) -> bool:
    """Whether `tenant_id` names a tenant the platform owns (evaluation, canary drills)."""
    return tenant_id in RESERVED_TENANT_IDS or tenant_id.startswith(RESERVED_TENANT_PREFIXES)


def check_customer_tenant(field: str, value: object) -> str:
    """`value` if it is a well-formed tenant id a customer may use (every CLI and Python API door)."""
    tenant = check_id(field, value)
    if is_reserved_tenant(tenant):
        raise ValidationError(
            field,
            f"{tenant!r} is reserved for the platform's own tenants (eval, eval-*, canary-*); choose another tenant id",
        )
    return tenant


@contextmanager
def platform_owned() -> Iterator[None]:
    """Within this block the store may create reserved tenants (the evaluation and the canary drill)."""
    token = _PLATFORM_OWNED.set(True)
    try:
        yield
    finally:
        _PLATFORM_OWNED.reset(token)


def check_new_tenant(tenant_id: str) -> str:
    """A tenant id the store may create now: reserved ids only inside `platform_owned()`."""
    if is_reserved_tenant(tenant_id) and not _PLATFORM_OWNED.get():
        return check_customer_tenant("tenant", tenant_id)
    return tenant_id


def check_optional_id(field: str, value: str | None) -> str | None:
    return None if value is None else check_id(field, value)


def new_memory_id() -> str:
    return "m_" + uuid.uuid4().hex


def check_memory_id(field: str, value: object) -> str:
    if not isinstance(value, str) or not _MEMORY_ID_RE.fullmatch(value):
        raise ValidationError(field, "must look like 'm_' followed by 32 lowercase hex digits")
    return value


def check_text(field: str, value: object, *, required: bool = True) -> str:
    """Memory text: non-blank, at most 64 KiB of UTF-8. SQL metacharacters are legal content.

    NUL is refused: PostgreSQL `text` cannot hold it (and a prompt or query with NUL is garbage,
    not content). Lone surrogates are refused: they are not UTF-8 (see `check_utf8`).
    """
    if not isinstance(value, str):
        raise ValidationError(field, "must be a string")
    check_utf8(field, value)
    if required and not value.strip():
        raise ValidationError(field, "must not be empty or whitespace")
    if "\x00" in value:
        raise ValidationError(field, "must not contain NUL characters")
    size = len(value.encode("utf-8"))
    if size > MAX_TEXT_BYTES:
        raise ValidationError(field, f"is {size} bytes; the limit is {MAX_TEXT_BYTES} bytes (64 KiB)")
    return value


def check_category(value: object, field: str = "category") -> str:
    if not isinstance(value, str) or not _CATEGORY_RE.fullmatch(value):
        raise ValidationError(field, "must be 1-32 characters of lowercase letters, digits and '_'")
    return value


def check_confidence(value: object, field: str = "confidence") -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValidationError(field, "must be a number between 0 and 1")
    number = float(value)
    if math.isnan(number) or not 0.0 <= number <= 1.0:
        raise ValidationError(field, "must be a number between 0 and 1")
    return number


def check_sharing_mode(value: object) -> str:
    if value not in SHARING_MODES:
        raise ValidationError("sharing_mode", f"must be one of {', '.join(SHARING_MODES)}")
    assert isinstance(value, str)
    return value


def check_version(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_VERSION:
        raise ValidationError("version", f"must be an integer from 1 to {MAX_VERSION}")
    return value


def _kind(value: object) -> str:
    return "None" if value is None else type(value).__name__


def check_bool(field: str, value: object) -> bool:
    """`value` if it is exactly a bool: "false", "no", 0 and None are not (bool("false") is True)."""
    if not isinstance(value, bool):
        raise ValidationError(field, f"must be true or false (a bool), got {_kind(value)}")
    return value


def check_optional_bool(field: str, value: object) -> bool | None:
    return None if value is None else check_bool(field, value)


def check_optional_text(field: str, value: object) -> str | None:
    return None if value is None else check_text(field, value)


def check_optional_str(field: str, value: object, *, limit: int = 200) -> str | None:
    """A short free-form string (a confirmation, a basis), or None."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise ValidationError(field, f"must be a string, got {_kind(value)}")
    check_utf8(field, value)
    if "\x00" in value or len(value) > limit:
        raise ValidationError(field, f"must be at most {limit} characters, without NUL")
    return value


def check_items(field: str, value: object) -> list[dict[str, Any]]:
    """A list (or tuple) of mappings, such as write_many's items, copied (a caller mutating its own
    items during the write changes nothing); each item's fields are checked by the caller."""
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise ValidationError(field, f"must be a list of mappings, got {_kind(value)}")
    for n, item in enumerate(value):
        if not isinstance(item, Mapping):
            raise ValidationError(f"{field}[{n}]", f"must be a mapping of memory fields, got {_kind(item)}")
        for key in item:
            if not isinstance(key, str):
                raise ValidationError(f"{field}[{n}]", f"field names must be strings, got {_kind(key)}")
    return [dict(item) for item in value]


RECALL_MODES = ("semantic", "keyword", "hybrid")
MAX_K = 100


def check_recall(k: object, mode: object) -> tuple[int, str]:
    """A recall's `k` (an integer from 1 to 100) and `mode` (semantic, keyword or hybrid)."""
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_K:
        raise ValidationError("k", f"must be an integer from 1 to {MAX_K}")
    if not isinstance(mode, str) or mode not in RECALL_MODES:
        raise ValidationError("mode", f"must be one of {', '.join(RECALL_MODES)}")
    return k, mode
