"""Where the mflow binary is: MFLOW_BIN, else beside this installation (the wheel puts it in the
scripts directory of the environment it is installed into), else PATH."""

from __future__ import annotations

import os
import shutil
import sys
import sysconfig
from pathlib import Path

from .errors import BinaryNotFound

ENV = "MFLOW_BIN"


def _scripts_dirs() -> list[Path]:
    """The scripts directories an installation of this module may have put the binary into."""
    dirs = [sysconfig.get_path("scripts")]
    # pip install --user
    user = {"posix": "posix_user", "nt": "nt_user"}.get(os.name)
    if sys.platform == "darwin" and sys._framework:  # type: ignore[attr-defined]
        user = "osx_framework_user"
    if user and user in sysconfig.get_scheme_names():
        dirs.append(sysconfig.get_path("scripts", scheme=user))
    # pip install --target DIR: the package in DIR, the binary in DIR/bin
    dirs.append(str(Path(__file__).resolve().parent.parent / "bin"))
    return [Path(d) for d in dirs if d]


def _executable(p: Path) -> bool:
    return p.is_file() and os.access(p, os.X_OK)


def find_binary() -> str:
    """The path of the mflow binary this module runs."""
    given = os.environ.get(ENV)
    if given:
        if not _executable(Path(given)):
            raise BinaryNotFound(f"{ENV}={given} is not an executable file")
        return given
    name = "mflow" + (sysconfig.get_config_var("EXE") or "")
    for d in _scripts_dirs():
        if _executable(d / name):
            return str(d / name)
    found = shutil.which(name)
    if found:
        return found
    raise BinaryNotFound(
        "no mflow binary: the mflow wheel installs one beside this module (pip install mflow); "
        f"or set {ENV} to one, or put one on PATH"
    )
