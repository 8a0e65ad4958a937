"""Where the project's non-Python files live, and the name a tenant's files and collections go by."""

import hashlib
from pathlib import Path

__all__ = [
    "ASSETS_DIR",
    "PROJECT_ROOT",
    "tenant_hash",
]

PROJECT_ROOT = Path(__file__).resolve().parents[3]
ASSETS_DIR = PROJECT_ROOT / "assets"


def tenant_hash(tenant_id: str) -> str:
    """The name of what belongs to `tenant_id` outside PostgreSQL (its Chroma collection, its
    analytics directory): 32 lowercase hex digits of its SHA-256.

    Never the raw id: tenant ids differ in case only (`Acme`, `acme`), which a case-insensitive
    file system (macOS) would merge, and a listing of HOME must name no tenant. Stable: changing
    it orphans every collection and directory already named by it."""
    return hashlib.sha256(tenant_id.encode()).hexdigest()[:32]
