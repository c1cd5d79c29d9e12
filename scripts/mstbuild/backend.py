"""PEP 517 build backend: `pip install .`, `pip wheel .`, `python -m build`.

There is no setuptools here on purpose: the wheel is upstream's published wheel,
patched, so its metadata (dependencies, extras, console scripts) stays upstream's.
Config setting `upstream-wheel=PATH` (or $MST_UPSTREAM_WHEEL) builds offline from a
local copy of the pinned wheel.
"""

from __future__ import annotations

import os
import tarfile
import tempfile
from pathlib import Path

from . import core

SDIST_FILES = ["pyproject.toml", "README.md", "CHANGELOG.md", "patches", "scripts/mstbuild", "src"]


def _use_config(config_settings):
    wheel = (config_settings or {}).get("upstream-wheel")
    if wheel:
        os.environ[core.WHEEL_ENV] = str(wheel)


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    _use_config(config_settings)
    with tempfile.TemporaryDirectory(prefix="mst-build-") as scratch:
        tree = core.build_patched_tree(Path(scratch))
        wheel = core.pack_wheel(tree, Path(wheel_directory))
    return wheel.name


def build_sdist(sdist_directory, config_settings=None):
    pin = core.Pin.load()
    base = f"{pin.name}-{pin.version}+{core.local_version()}"
    path = Path(sdist_directory) / f"{base}.tar.gz"

    def skip_caches(info):
        return None if "__pycache__" in info.name else info

    with tarfile.open(path, "w:gz") as tar:
        for name in SDIST_FILES:
            tar.add(core.ROOT / name, arcname=f"{base}/{name}", filter=skip_caches)
        pkg_info = Path(tempfile.mkdtemp()) / "PKG-INFO"
        pkg_info.write_text(f"Metadata-Version: 2.1\nName: {pin.name}\nVersion: {pin.version}+{core.local_version()}\n")
        tar.add(pkg_info, arcname=f"{base}/PKG-INFO")
    return path.name
