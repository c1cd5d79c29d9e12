"""Build steps shared by the PEP 517 backend and the developer commands.

upstream wheel -> verify sha256 -> unpack -> apply patches/series with GNU patch
-> overlay src/ -> repack with our local version label (the `wheel` tool).
Every step works in a fresh temporary directory, so nothing from an earlier build
(setuptools' `build/`, a half-patched tree) can reach a wheel.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PATCHES = ROOT / "patches"
OVERLAY = ROOT / "src"
PACKAGE = "transformers"
WHEEL_ENV = "MST_UPSTREAM_WHEEL"  # path to a local copy of the pinned upstream wheel (offline builds)
PATCH_NAME = re.compile(r"^\d{4}-[a-z0-9][a-z0-9-]*\.patch$")


class BuildError(RuntimeError):
    """A build or patch-series step failed; the message says what and how to fix it."""


@dataclass(frozen=True)
class Pin:
    name: str
    version: str
    wheel: str
    sha256: str

    @classmethod
    def load(cls, path: Path = PATCHES / "upstream.toml") -> "Pin":
        with open(path, "rb") as f:
            data = tomllib.load(f)["upstream"]
        return cls(data["name"], data["version"], data["wheel"], data["sha256"])

    def save(self, path: Path = PATCHES / "upstream.toml") -> None:
        head = path.read_text().split("[upstream]")[0] if path.exists() else ""
        path.write_text(
            f'{head}[upstream]\nname = "{self.name}"\nversion = "{self.version}"\n'
            f'wheel = "{self.wheel}"\nsha256 = "{self.sha256}"\n'
        )


def local_version(overlay: Path = OVERLAY) -> str:
    """The `mst.N` label, read from src/transformers/_mst_version.py without importing it."""
    text = (overlay / PACKAGE / "_mst_version.py").read_text()
    match = re.search(r'^LOCAL_VERSION = "(mst\.\d+)"$', text, re.M)
    if not match:
        raise BuildError('src/transformers/_mst_version.py must define LOCAL_VERSION = "mst.N"')
    return match.group(1)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def verify_wheel(path: Path, pin: Pin) -> None:
    actual = sha256_of(path)
    if actual != pin.sha256:
        raise BuildError(
            f"upstream wheel {path} has the wrong sha256:\n  expected {pin.sha256}\n  actual   {actual}\n"
            f"It is not the published {pin.wheel}; nothing was built."
        )


def fetch_wheel(pin: Pin, dest: Path) -> Path:
    """The pinned upstream wheel, verified: from $MST_UPSTREAM_WHEEL if set, else `pip download`."""
    local = os.environ.get(WHEEL_ENV)
    if local:
        path = Path(local).expanduser().resolve()
        if not path.is_file():
            raise BuildError(f"{WHEEL_ENV}={local} is not a file (expected a copy of {pin.wheel})")
    else:
        dest.mkdir(parents=True, exist_ok=True)
        path = dest / pin.wheel
        if not path.exists():
            cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                   "--dest", str(dest), f"{pin.name}=={pin.version}"]
            result = subprocess.run(cmd, capture_output=True, text=True)
            if result.returncode != 0 or not path.exists():
                raise BuildError(
                    f"could not download {pin.wheel} ({' '.join(cmd)}):\n{result.stdout}{result.stderr}\n"
                    f"For an offline build set {WHEEL_ENV}=/path/to/{pin.wheel}."
                )
    verify_wheel(path, pin)
    return path


def unpack_wheel(wheel: Path, dest: Path) -> Path:
    """Unpack with the `wheel` tool (it checks the RECORD hashes); returns the tree root."""
    run([sys.executable, "-m", "wheel", "unpack", "--dest", str(dest), str(wheel)])
    (root,) = [p for p in dest.iterdir() if p.is_dir()]
    return root


def run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    if result.returncode != 0:
        raise BuildError(f"command failed: {' '.join(cmd)}\n{result.stdout}{result.stderr}")
    return result


# ----------------------------------------------------------------------------- the series


def read_series(patches: Path = PATCHES) -> list[Path]:
    """The patch files named in patches/series, in order, each checked to exist and stay in the package."""
    series = patches / "series"
    if not series.is_file():
        raise BuildError(f"{series} is missing")
    names = [line.strip() for line in series.read_text().splitlines()]
    names = [n for n in names if n and not n.startswith("#")]
    paths = []
    for name in names:
        if not PATCH_NAME.match(name):
            raise BuildError(f"{series}: {name!r} is not a patch name of the form NNNN-topic.patch")
        path = patches / name
        if not path.is_file():
            raise BuildError(f"{series} names {name}, but {path} does not exist")
        if names.count(name) > 1:
            raise BuildError(f"{series} names {name} more than once")
        check_patch_paths(path)
        paths.append(path)
    return paths


def check_patch_paths(patch: Path) -> list[str]:
    """Paths a patch touches; each must be a file inside the `transformers/` package."""
    touched = []
    for line in patch.read_text().splitlines():
        if line.startswith(("--- ", "+++ ")):
            path = line[4:].split("\t")[0].strip()
            if path == "/dev/null":
                continue
            rel = path.split("/", 1)[1] if path.startswith(("a/", "b/")) else path
            parts = Path(rel).parts
            if not parts or parts[0] != PACKAGE or ".." in parts or Path(rel).is_absolute():
                raise BuildError(f"{patch.name} touches {path}, which is outside the {PACKAGE}/ package")
            touched.append(rel)
    if not touched:
        raise BuildError(f"{patch.name} contains no diff")
    return sorted(set(touched))


@dataclass
class PatchResult:
    patch: str
    status: str  # "applied" | "offset" | "fuzz" | "rejected"
    output: str
    rejects: str = ""

    def describe(self) -> str:
        words = {"applied": "applied cleanly", "offset": "applied with offset",
                 "fuzz": "applied with fuzz", "rejected": "REJECTED"}
        text = f"{self.patch}: {words[self.status]}"
        if self.status != "applied":
            # patch's own report, file by file, without its "saving rejects to <tmp file>" noise
            details = [ln.split(" -- saving rejects")[0] for ln in self.output.splitlines()
                       if ln.startswith(("patching file", "Hunk")) or "FAILED" in ln]
            text += "".join(f"\n    {ln}" for ln in details)
        if self.rejects:
            text += "\n    rejected hunk(s):\n" + "".join(f"      {ln}\n" for ln in self.rejects.splitlines())
        return text


def apply_patch(tree: Path, patch: Path, fuzz: int = 0) -> PatchResult:
    """Apply one patch to `tree` with GNU patch; classify the outcome from patch's own report."""
    if shutil.which("patch") is None:
        raise BuildError("GNU patch is required to build transformers-mst (e.g. `apt-get install patch`)")
    reject = tree.parent / f".{patch.name}.rej"
    cmd = ["patch", "-p1", "--batch", "--forward", f"--fuzz={fuzz}", "--no-backup-if-mismatch",
           f"--reject-file={reject}", "-d", str(tree), "-i", str(patch)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    output = result.stdout + result.stderr
    rejects = reject.read_text() if reject.exists() else ""
    reject.unlink(missing_ok=True)
    if result.returncode != 0:
        status = "rejected"
    elif "with fuzz" in output:
        status = "fuzz"
    elif "offset" in output:
        status = "offset"
    else:
        status = "applied"
    return PatchResult(patch.name, status, output, rejects)


def apply_series_strict(tree: Path, patches: list[Path]) -> None:
    """Apply every patch exactly (no fuzz, no offset), or raise naming the patch and its hunk."""
    for patch in patches:
        result = apply_patch(tree, patch, fuzz=0)
        if result.status != "applied":
            raise BuildError(
                f"patch {patch} does not apply exactly to upstream; nothing was built.\n"
                f"{result.describe()}\n{result.output}"
                "Regenerate the series with `make workspace`, fix the tree, then `make patches`."
            )


def overlay(tree: Path, source: Path = OVERLAY) -> None:
    """Add our own files (src/transformers/...) to the tree; they must not replace upstream files."""
    for path in sorted((source / PACKAGE).rglob("*")):
        if path.is_dir() or "__pycache__" in path.parts or path.suffix in (".pyc", ".pyo"):
            continue
        rel = path.relative_to(source)
        target = tree / rel
        if target.exists():
            raise BuildError(f"src/{rel} would overwrite an upstream file; change upstream files with a patch")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)


def build_patched_tree(scratch: Path, pin: Pin | None = None) -> Path:
    """Pristine upstream wheel tree + series + overlay, in `scratch`. Returns the tree root."""
    pin = pin or Pin.load()
    patches = read_series()  # check the series before spending time on the wheel
    wheel = fetch_wheel(pin, scratch / "download")
    tree = unpack_wheel(wheel, scratch / "unpacked")
    apply_series_strict(tree, patches)
    overlay(tree)
    return tree


def pack_wheel(tree: Path, dest: Path) -> Path:
    """Repack with the `wheel` tool (renames the dist-info, sets Version, rewrites RECORD) into `dest`."""
    packed = tree.parent / "packed"
    packed.mkdir()
    run([sys.executable, "-m", "wheel", "pack", "--local-version", local_version(), "--dest-dir", str(packed), str(tree)])
    (wheel,) = packed.glob("*.whl")
    dest.mkdir(parents=True, exist_ok=True)
    return Path(shutil.move(str(wheel), dest / wheel.name))
