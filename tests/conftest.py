"""Shared fixtures: the repository, the pinned upstream wheel, and trees built from it."""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

from mstbuild import core, series  # noqa: E402

import time_budget  # noqa: E402


def pytest_configure(config):
    time_budget.register(config)

# DeepSpeed JIT-builds its CPU shared-memory comm op (deepspeed/comm/torch.py, build_shm_op) on the
# first init_distributed, under torch's file lock `<TORCH_EXTENSIONS_DIR>/<op>/lock`. A process killed
# mid-build leaves that lock behind, and every later DeepSpeed process waits on it forever (our
# distributed tests then time out). So the suite builds into the checkout's own .cache/ (ignored by
# git; a clean clone builds afresh, about a minute on 2 cores), never into the user's ~/.cache, and
# drops a lock there older than any build takes. An explicit TORCH_EXTENSIONS_DIR is respected.
# Per Python and torch build, as torch's own default is (a set TORCH_EXTENSIONS_DIR gets no subfolder).
TORCH_EXTENSIONS_DIR = os.environ.setdefault(
    "TORCH_EXTENSIONS_DIR",
    str(REPO / ".cache" / "torch_extensions" / f"{sys.implementation.cache_tag}-torch{torch.__version__}"),
)
STALE_LOCK_SECONDS = 15 * 60
if Path(TORCH_EXTENSIONS_DIR).is_relative_to(REPO):
    for lock in Path(TORCH_EXTENSIONS_DIR).glob("*/lock"):
        if time.time() - lock.stat().st_mtime > STALE_LOCK_SECONDS:
            lock.unlink(missing_ok=True)


@pytest.fixture(scope="session")
def pin():
    return core.Pin.load()


@pytest.fixture(scope="session")
def upstream_wheel(pin):
    return series.cached_wheel(pin)


@pytest.fixture(scope="session")
def pristine_tree(upstream_wheel, tmp_path_factory):
    """Upstream's wheel unpacked, untouched: a directory holding transformers/."""
    return core.unpack_wheel(upstream_wheel, tmp_path_factory.mktemp("pristine"))


@pytest.fixture(scope="session")
def expected_tree(upstream_wheel, tmp_path_factory, monkeypatch_session):
    """What the installed package must be: pristine + patches/series + src/ overlay."""
    monkeypatch_session.setenv(core.WHEEL_ENV, str(upstream_wheel))
    return core.build_patched_tree(tmp_path_factory.mktemp("expected"))


@pytest.fixture(scope="session")
def monkeypatch_session():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def copy_repo(dest: Path) -> Path:
    """A copy of the project's own files (no venv, caches, work tree or build outputs)."""
    ignore = shutil.ignore_patterns(".venv", ".cache", "work", "dist", "out", ".git", "__pycache__", ".pytest_cache")
    shutil.copytree(REPO, dest, ignore=ignore)
    return dest


def run_py(args, cwd=None, env_extra=None, check=False):
    env = dict(os.environ, **(env_extra or {}))
    result = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True)
    if check and result.returncode != 0:
        raise AssertionError(f"{args} failed:\n{result.stdout}\n{result.stderr}")
    return result
