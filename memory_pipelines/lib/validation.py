"""Validation of every caller-supplied field, before anything is written."""

from __future__ import annotations

import math
import re
import uuid

from memory_pipelines.lib.errors import ValidationError

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


def check_category(value: object) -> str:
    if not isinstance(value, str) or not _CATEGORY_RE.fullmatch(value):
        raise ValidationError("category", "must be 1-32 characters of lowercase letters, digits and '_'")
    return value


def check_confidence(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValidationError("confidence", "must be a number between 0 and 1")
    number = float(value)
    if math.isnan(number) or not 0.0 <= number <= 1.0:
        raise ValidationError("confidence", "must be a number between 0 and 1")
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
