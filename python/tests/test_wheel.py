"""The wheel itself (``MFLOW_WHEEL``, set by scripts/test-python): what it carries, how pip
will install it, and that its binary is the mflow of its version."""

from __future__ import annotations

import email.parser
import json
import os
import stat
import subprocess
import zipfile
from pathlib import Path

import pytest

WHEEL = os.environ.get("MFLOW_WHEEL", "")

pytestmark = pytest.mark.skipif(not WHEEL, reason="no wheel under test (scripts/test-python sets MFLOW_WHEEL)")

# What a wheel of mflow may weigh: the stripped binary compresses to about a third of this.
MAX_BYTES = 60 * 2**20


def names() -> list[str]:
    with zipfile.ZipFile(WHEEL) as z:
        return z.namelist()


def dist_info(name: str) -> str:
    with zipfile.ZipFile(WHEEL) as z:
        (path,) = [n for n in z.namelist() if n.endswith(f".dist-info/{name}")]
        return z.read(path).decode()


def version() -> str:
    return email.parser.Parser().parsestr(dist_info("METADATA"))["Version"]


def test_the_wheel_carries_the_binary_and_the_module_and_nothing_else():
    listed = names()
    v = version()
    module = sorted(n for n in listed if n.startswith("mflow/"))
    sources = Path(__file__).resolve().parents[1] / "mflow"
    assert module == sorted(f"mflow/{p.name}" for p in sources.iterdir() if p.is_file() and p.suffix != ".pyc")
    assert f"mflow-{v}.data/scripts/mflow" in listed
    rest = [n for n in listed if not n.startswith(("mflow/", f"mflow-{v}.data/", f"mflow-{v}.dist-info/"))]
    assert rest == [], f"the wheel carries more than the module and the binary: {rest}"
    assert not [n for n in listed if "tests/" in n or n.endswith((".pyc", ".ipynb"))]


def test_the_wheel_is_tagged_for_linux_and_any_python3():
    tags = [line.split(": ", 1)[1] for line in dist_info("WHEEL").splitlines() if line.startswith("Tag: ")]
    assert tags and all(t.startswith("py3-none-") and "linux" in t for t in tags), tags
    assert "Root-Is-Purelib: false" in dist_info("WHEEL")


def test_the_metadata():
    meta = email.parser.Parser().parsestr(dist_info("METADATA"))
    assert meta["Name"] == "mflow"
    assert meta["Requires-Python"] == ">=3.10"
    assert meta.get_all("Requires-Dist") is None, "the module depends on nothing"
    assert meta.get("License-Expression") == "Apache-2.0"
    assert "pip install mflow" in meta.get_payload()


def test_the_binary_is_executable_stripped_and_small_enough():
    with zipfile.ZipFile(WHEEL) as z:
        info = z.getinfo(f"mflow-{version()}.data/scripts/mflow")
        head = z.open(info).read(4)
    assert head == b"\x7fELF"
    assert stat.S_IMODE(info.external_attr >> 16) & 0o111, "pip installs it executable"
    assert os.path.getsize(WHEEL) < MAX_BYTES, f"{os.path.getsize(WHEEL)} bytes"


def test_the_installed_binary_is_the_wheels_version(tmp_path):
    import mflow

    binary = mflow.find_binary()
    assert subprocess.run([binary, "--version"], capture_output=True, text=True, check=True).stdout.split() == [
        "mflow",
        version(),
    ]
    out = subprocess.run(["file", binary], capture_output=True, text=True, check=False).stdout
    if out:
        assert "not stripped" not in out, out
    # The main job's plan from outside the checkout, nothing written into it.
    spec = Path(__file__).resolve().parents[2] / "specs" / "gpt-tp2.toml"
    listed = subprocess.run(
        [binary, "plan", str(spec), "--set", f"pipeline.workdir={json.dumps(str(tmp_path / 'work'))}"],
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
    ).stdout
    assert "train" in listed and "export" in listed
