"""An installed ddtree-ops (a wheel, not this checkout) deploys its own bundle and finds its
prompt sets from any directory."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def test_the_package_list_names_every_package_of_the_checkout() -> None:
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {
        ".".join(p.parent.relative_to(REPO).parts)
        for p in (REPO / "ddtree_ops").rglob("__init__.py")
        if "__pycache__" not in p.parts
    }
    assert found <= listed, sorted(found - listed)
    assert {"ddtree_ops._shipped.patches", "ddtree_ops._shipped.bench_configs"} <= listed


def test_an_installed_wheel_deploys_its_bundle_and_reads_its_prompt_sets_from_anywhere(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(REPO)],
        check=True, capture_output=True, timeout=240,
    )
    (wheel,) = wheels.glob("ddtree_ops-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", str(wheel)],
                   check=True, capture_output=True, timeout=240)
    # Its dependencies from this venv, as a plain path: this venv's own (editable) ddtree_ops
    # is a .pth finder there, which a plain path does not run.
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          check=True, capture_output=True, text=True).stdout.strip()
    Path(site, "deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    inv = elsewhere / "inv.yaml"
    inv.write_text(yaml.safe_dump({"all": {"hosts": {"bare": {
        "ansible_connection": "local", "ddtree": {"python": sys.executable, "run_dir": str(tmp_path / "run")}}}}}))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "DDTREE_OPS_INVENTORY")}
    env["COLUMNS"] = "200"

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(python), "-m", "ddtree_ops", "-i", str(inv), *args], cwd=elsewhere, env=env,
                              capture_output=True, text=True, timeout=120)

    where = subprocess.run([str(python), "-c", "import ddtree_ops.shipped as s; print(s.DEFAULT_BUNDLE)"],
                           cwd=elsewhere, env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert where.startswith(site) and where.endswith("ddtree_ops/_shipped/patches/ddtree_temperature")
    # The bundle is found (its name and version in the title); this host has no SGLang: exit 4.
    res = run("deploy", "bare", "--dry-run")
    assert res.returncode == 4, res.stderr
    assert "ddtree_temperature 0.2.0" in res.stdout and "package 'sglang' is not installed" in res.stdout
    # The shipped prompt sets, and a shipped sweep, from the installed package too.
    sweep = elsewhere / "s.yaml"
    sweep.write_text("name: s\ntargets: [bare]\ngrid: {budget: [4]}\nworkload: {prompt_set: mixed, num_prompts: 4}\n")
    res = run("bench", "--sweep", str(sweep), "--dry-run")
    assert res.returncode == 0, res.stderr
    assert "4 prompts" in res.stdout
