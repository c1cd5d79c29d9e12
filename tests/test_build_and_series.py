"""The build and the patch-series tools, run on copies of the repository.

Each build runs `pip wheel` on a copy, as a user would; failures must stop it with a
message naming what is wrong, and leave no wheel behind.
"""

import shutil
import zipfile

import pytest
from conftest import copy_repo, run_py
from mstbuild import core


@pytest.fixture
def repo(tmp_path):
    return copy_repo(tmp_path / "repo")


@pytest.fixture
def wheel_env(upstream_wheel):
    return {core.WHEEL_ENV: str(upstream_wheel)}


def pip_wheel(repo, env, isolated=False):
    out = repo.parent / "out"
    args = ["-m", "pip", "wheel", "--no-deps", "-w", str(out), str(repo)]
    if not isolated:
        args.insert(3, "--no-build-isolation")
    result = run_py(args, env_extra=env)
    wheels = sorted(out.glob("*.whl")) if out.exists() else []
    return result, wheels


def mst(repo, *args, env=None):
    return run_py(["-m", "mstbuild", *args], cwd=repo / "scripts", env_extra=env)


def test_isolated_build_ignores_stale_artifacts(repo, wheel_env, pin):
    # A stale setuptools build/ tree and a stray file must not leak into the wheel.
    stale = repo / "build" / "lib" / "transformers"
    stale.mkdir(parents=True)
    (stale / "stale_module.py").write_text("raise RuntimeError('stale')\n")
    result, wheels = pip_wheel(repo, wheel_env, isolated=True)
    assert result.returncode == 0, result.stdout + result.stderr
    (wheel,) = wheels
    assert wheel.name == f"transformers-{pin.version}+{core.local_version()}-py3-none-any.whl"
    names = zipfile.ZipFile(wheel).namelist()
    assert not [n for n in names if "stale_module" in n]
    assert "transformers/_mst_version.py" in names


def test_wrong_hash_stops_build(repo, upstream_wheel, tmp_path):
    bad = tmp_path / upstream_wheel.name
    shutil.copy(upstream_wheel, bad)
    with open(bad, "ab") as f:
        f.write(b"tampered")
    result, wheels = pip_wheel(repo, {core.WHEEL_ENV: str(bad)})
    assert result.returncode != 0 and wheels == []
    out = result.stdout + result.stderr
    assert "wrong sha256" in out and core.Pin.load().sha256 in out and core.sha256_of(bad) in out


def test_rejected_hunk_stops_build(repo, wheel_env):
    patch = repo / "patches" / "0001-version-string.patch"
    # Break a context line of the first hunk: it no longer matches upstream.
    patch.write_text(patch.read_text().replace(" from pathlib import Path\n", " from pathlib import PurePath\n", 1))
    result, wheels = pip_wheel(repo, wheel_env)
    assert result.returncode != 0 and wheels == []
    out = result.stdout + result.stderr
    assert "0001-version-string.patch" in out and "Hunk #1 FAILED" in out and "PurePath" in out


def test_missing_patch_stops_build(repo, wheel_env):
    with open(repo / "patches" / "series", "a") as f:
        f.write("0999-not-there.patch\n")
    result, wheels = pip_wheel(repo, wheel_env)
    assert result.returncode != 0 and wheels == []
    assert "names 0999-not-there.patch" in result.stdout + result.stderr


def test_patch_outside_package_stops_build(repo, wheel_env):
    (repo / "patches" / "0002-escape.patch").write_text(
        "--- a/setup.py\n+++ b/setup.py\n@@ -1 +1 @@\n-x\n+y\n"
    )
    with open(repo / "patches" / "series", "a") as f:
        f.write("0002-escape.patch\n")
    result, wheels = pip_wheel(repo, wheel_env)
    assert result.returncode != 0 and wheels == []
    assert "0002-escape.patch touches a/setup.py, which is outside the transformers/ package" in result.stdout + result.stderr


def test_overlay_may_not_replace_upstream_file(repo, wheel_env):
    (repo / "src" / "transformers" / "activations.py").write_text("# a copy of an upstream file\n")
    result, wheels = pip_wheel(repo, wheel_env)
    assert result.returncode != 0 and wheels == []
    assert "src/transformers/activations.py would overwrite an upstream file" in result.stdout + result.stderr


def test_workspace_roundtrip_and_new_patch(repo, wheel_env):
    before = {p.name: p.read_bytes() for p in (repo / "patches").iterdir()}
    assert mst(repo, "workspace", env=wheel_env).returncode == 0
    assert (repo / "work" / "pristine" / "transformers" / "__init__.py").is_file()
    regenerated = mst(repo, "patches", env=wheel_env)
    assert regenerated.returncode == 0, regenerated.stderr
    assert {p.name: p.read_bytes() for p in (repo / "patches").iterdir()} == before

    # An uncommitted edit is refused: it must be given to a patch first.
    patched = repo / "work" / "patched"
    target = patched / "transformers" / "activations.py"
    target.write_text(target.read_text() + "\n# edited\n")
    refused = mst(repo, "patches", env=wheel_env)
    assert refused.returncode == 2 and "uncommitted changes" in refused.stderr

    from mstbuild.series import git

    series_before = [p.name for p in core.read_series(repo / "patches")]
    git(patched, "commit", "-qam", "0099-test-edit")
    assert mst(repo, "patches", env=wheel_env).returncode == 0
    assert [p.name for p in core.read_series(repo / "patches")] == series_before + ["0099-test-edit.patch"]
    assert "+# edited" in (repo / "patches" / "0099-test-edit.patch").read_text()
    # The new series builds.
    result, wheels = pip_wheel(repo, wheel_env)
    assert result.returncode == 0, result.stderr
    assert "# edited" in zipfile.ZipFile(wheels[0]).read("transformers/activations.py").decode()

    # workspace refuses to overwrite work/ unless forced.
    again = mst(repo, "workspace", env=wheel_env)
    assert again.returncode == 2 and "FORCE=1" in again.stderr


def test_rebase_onto_same_release_is_clean(repo, wheel_env, pin):
    before = {p.name: p.read_bytes() for p in (repo / "patches").iterdir()}
    result = mst(repo, "rebase", "--upstream", pin.version, "--sha256", pin.sha256, "--no-test", env=wheel_env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0001-version-string.patch: applied cleanly" in result.stdout
    n = len(core.read_series(repo / "patches"))
    assert f"patches: {n}: {n} applied cleanly, 0 with offset, 0 with fuzz, 0 rejected" in result.stdout
    assert "tests: not run (--no-test)" in result.stdout
    assert {p.name: p.read_bytes() for p in (repo / "patches").iterdir()} == before
    # work/ now holds the stack; another rebase refuses to discard it unless forced.
    again = mst(repo, "rebase", "--upstream", pin.version, "--sha256", pin.sha256, "--no-test", env=wheel_env)
    assert again.returncode == 2 and "FORCE=1" in again.stderr


def test_rebase_reports_offset_and_regenerates_exact_patches(repo, wheel_env, pin):
    patch = repo / "patches" / "0001-version-string.patch"
    original = patch.read_text()
    assert "\n@@ -25,6 +25,11 @@" in original
    patch.write_text(original.replace("\n@@ -25,6 +25,11 @@", "\n@@ -21,6 +21,11 @@", 1))  # as if upstream moved it
    result = mst(repo, "rebase", "--upstream", pin.version, "--sha256", pin.sha256, "--no-test", env=wheel_env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0001-version-string.patch: applied with offset" in result.stdout
    assert "(offset 4 lines)" in result.stdout and ", 1 with offset, 0 with fuzz, 0 rejected" in result.stdout
    assert patch.read_text() == original  # regenerated against the release: exact again


def test_rebase_rejection_leaves_stack_to_resolve(repo, wheel_env, pin):
    from mstbuild.series import git

    patch = repo / "patches" / "0001-version-string.patch"
    original = patch.read_text()
    # A different release would not have this context line; on this one the patch is rejected the same way.
    patch.write_text(original.replace("\n \n+# transformers-mst", "\n not upstream\n+# transformers-mst", 1))
    broken = patch.read_text()
    result = mst(repo, "rebase", "--upstream", pin.version, "--sha256", pin.sha256, "--no-test", env=wheel_env)
    assert result.returncode == 1
    rej = repo / "work" / "rejects" / "0001-version-string.rej"
    assert rej.is_file() and "not upstream" in rej.read_text()
    assert "work/rejects/0001-version-string.rej" in result.stdout and "tests: not run" in result.stdout
    patched = repo / "work" / "patched"
    subjects = git(patched, "log", "--format=%s", "pristine..HEAD").split()
    assert subjects[-1] == "0001-version-string" and len(subjects) == len(core.read_series(repo / "patches"))

    # Unresolved: `make patches` refuses and leaves patches/ alone.
    refused = mst(repo, "patches", env=wheel_env)
    assert refused.returncode == 2 and "unresolved rejects" in refused.stderr
    assert patch.read_text() == broken

    # Resolve as docs/rebase.md says: apply the hunk, fold it into the patch's commit, delete the .rej.
    fix = repo.parent / "fix.patch"
    fix.write_text(original)
    git(patched, "apply", str(fix))
    first = git(patched, "rev-list", "--reverse", "pristine..HEAD").split()[0]
    git(patched, "commit", "-qa", f"--fixup={first}")
    git(patched, "-c", "sequence.editor=:", "rebase", "-q", "-i", "--autosquash", "pristine")
    rej.unlink()
    done = mst(repo, "patches", env=wheel_env)
    assert done.returncode == 0, done.stderr
    assert patch.read_text() == original


def test_rebase_report_helpers():
    from mstbuild.series import patch_report, pytest_summary

    assert pytest_summary("....\n===== 3 passed, 1 skipped in 2.50s =====\n") == "3 passed, 1 skipped in 2.50s"
    assert pytest_summary("F.\n1 failed, 1 passed in 0.31s\n") == "1 failed, 1 passed in 0.31s"
    assert pytest_summary("ImportError while loading conftest\n") == "no pytest summary found"
    results = [core.PatchResult("0001-a.patch", "applied", ""),
               core.PatchResult("0002-b.patch", "offset", "patching file x\nHunk #1 succeeded at 9 (offset 2 lines).\n"),
               core.PatchResult("0003-c.patch", "fuzz", "Hunk #1 succeeded at 3 with fuzz 1.\n"),
               core.PatchResult("0004-d.patch", "rejected", "Hunk #1 FAILED at 7.\n", "@@ -7 +7 @@\n-a\n+b\n")]
    report = patch_report(results)
    assert "0002-b.patch: applied with offset\n    patching file x\n    Hunk #1 succeeded at 9 (offset 2 lines)." in report
    assert "0003-c.patch: applied with fuzz" in report and "0004-d.patch: REJECTED" in report
    assert "work/rejects/0004-d.rej" in report
    assert report.endswith("patches: 4: 1 applied cleanly, 1 with offset, 1 with fuzz, 1 rejected")


def test_rebase_reports_rejection_and_changes_nothing(repo, wheel_env, pin):
    patch = repo / "patches" / "0001-version-string.patch"
    # Fuzz may drop the outer context lines, never the one next to the change: break that one.
    text = patch.read_text()
    assert "\n \n+# transformers-mst" in text
    patch.write_text(text.replace("\n \n+# transformers-mst", "\n not upstream\n+# transformers-mst", 1))
    before = {p.name: p.read_bytes() for p in (repo / "patches").iterdir()}
    result = mst(repo, "rebase", "--upstream", pin.version, "--sha256", pin.sha256, "--no-test", env=wheel_env)
    assert result.returncode == 1
    assert "0001-version-string.patch: REJECTED" in result.stdout and "rejected hunk" in result.stdout
    assert "patches/ and patches/upstream.toml are unchanged" in result.stdout
    assert {p.name: p.read_bytes() for p in (repo / "patches").iterdir()} == before


def test_rebase_refuses_wrong_hash(repo, wheel_env, pin):
    result = mst(repo, "rebase", "--upstream", pin.version, "--sha256", "0" * 64, env=wheel_env)
    assert result.returncode == 2 and "wrong sha256" in result.stderr
    assert not (repo / "work").exists()  # nothing is touched before the wheel is verified
