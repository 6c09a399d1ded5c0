"""A wheel built byte-for-byte the same on every machine (fixed member times and order), with
its RECORD: the tests' pinned corpus (data.source=wheel)."""

from __future__ import annotations

import base64
import hashlib
import zipfile
from pathlib import Path


def record_digest(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def make_wheel(folder: Path, name: str, version: str, files: dict[str, bytes]) -> Path:
    """``folder/name-version-py3-none-any.whl`` holding ``files`` and a RECORD of them."""
    folder.mkdir(parents=True, exist_ok=True)
    info = f"{name}-{version}.dist-info"
    members = dict(files)
    members[f"{info}/METADATA"] = (
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode()
    )
    record = "".join(f"{m},{record_digest(b)},{len(b)}\n" for m, b in members.items())
    members[f"{info}/RECORD"] = (record + f"{info}/RECORD,,\n").encode()
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for m in sorted(members):
            zi = zipfile.ZipInfo(m, date_time=(1980, 1, 1, 0, 0, 0))
            zi.external_attr = 0o644 << 16
            z.writestr(zi, members[m])
    return path


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
