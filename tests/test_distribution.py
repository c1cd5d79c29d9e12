"""The installed distribution is upstream's wheel + our series + our files, and nothing else."""

import filecmp
import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from conftest import REPO, run_py
from mstbuild import core
from tiny_models import FAMILIES, SSM_FAMILIES


def package_files(root: Path) -> set[str]:
    return {
        str(p.relative_to(root))
        for p in root.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
    }


def test_version_has_local_label(pin):
    expected = f"{pin.version}+{core.local_version()}"
    assert transformers.__version__ == expected
    assert importlib.metadata.version("transformers") == expected


def test_installed_package_is_pristine_plus_series(pristine_tree, expected_tree):
    installed = Path(transformers.__file__).parent
    expected = expected_tree / "transformers"
    assert package_files(installed) == package_files(expected)
    _, mismatch, errors = filecmp.cmpfiles(installed, expected, sorted(package_files(expected)), shallow=False)
    assert mismatch == [] and errors == []

    # Files no patch touches are byte-identical to upstream; patched ones differ from it.
    patched = {path for patch in core.read_series() for path in core.check_patch_paths(patch)}
    patched = {p.removeprefix("transformers/") for p in patched}
    assert patched, "the series must change at least one upstream file"
    pristine = pristine_tree / "transformers"
    untouched = sorted(package_files(pristine) - patched)
    _, mismatch, errors = filecmp.cmpfiles(installed, pristine, untouched, shallow=False)
    assert mismatch == [] and errors == []
    for rel in patched:
        assert (installed / rel).read_bytes() != (pristine / rel).read_bytes(), rel
    # Our own files are exactly the ones under src/transformers/.
    ours = package_files(installed) - package_files(pristine)
    assert ours == package_files(REPO / "src" / "transformers")


def test_upstream_metadata_kept(upstream_wheel):
    import zipfile

    with zipfile.ZipFile(upstream_wheel) as whl:
        (meta_name,) = [n for n in whl.namelist() if n.endswith(".dist-info/METADATA")]
        upstream_meta = whl.read(meta_name).decode()
    upstream_requires = sorted(ln.split(": ", 1)[1] for ln in upstream_meta.splitlines() if ln.startswith("Requires-Dist: "))
    dist = importlib.metadata.distribution("transformers")
    assert sorted(dist.requires) == upstream_requires
    assert "torch" in dist.metadata.get_all("Provides-Extra")
    scripts = {ep.name: ep.value for ep in dist.entry_points if ep.group == "console_scripts"}
    assert scripts == {"transformers": "transformers.cli.transformers:main"}


def test_pip_check_clean_and_pin_satisfied(pin):
    check = run_py(["-m", "pip", "check"])
    assert check.returncode == 0, check.stdout + check.stderr
    # With no index at all, this can only succeed if the installed distribution satisfies it.
    again = run_py(["-m", "pip", "install", "--no-index", f"transformers=={pin.version}"])
    assert again.returncode == 0, again.stdout + again.stderr
    assert "already satisfied" in again.stdout


@pytest.mark.parametrize("family", sorted(FAMILIES) + sorted(SSM_FAMILIES))
def test_flag_off_bit_identical_to_pristine_upstream(family, pristine_tree, tmp_path):
    probe = Path(__file__).parent / "flag_off_probe.py"
    ours, theirs = tmp_path / "ours.pt", tmp_path / "upstream.pt"
    run_py([str(probe), family, str(ours)], check=True)
    run_py([str(probe), family, str(theirs)], env_extra={"PYTHONPATH": str(pristine_tree)}, check=True)
    a, b = torch.load(ours), torch.load(theirs)
    assert b["file"].startswith(str(pristine_tree)) and b["version"] == core.Pin.load().version
    assert a["file"] == transformers.__file__
    assert torch.equal(a["loss"], b["loss"]) and torch.equal(a["logits"], b["logits"])
    assert a["grads"].keys() == b["grads"].keys()
    for name in a["grads"]:
        assert torch.equal(a["grads"][name], b["grads"][name]), name
        assert torch.equal(a["checkpointed_grads"][name], b["checkpointed_grads"][name]), name


def test_console_script_runs():
    result = subprocess.run([Path(sys.executable).parent / "transformers", "--help"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
