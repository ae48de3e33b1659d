"""The package as a user installs it: a wheel built from this checkout and an editable
install, each in a fresh venv, used from outside the checkout.

Offline and quick: one wheel per module (pip wheel without build isolation, from a copy of
the sources so no stale build/ folder can leak in), venvs made without pip and installed
into by this interpreter's pip (``pip --python``, ``--no-deps --no-index``); their
dependencies (numpy, torch, jax) come from this environment's site-packages through a
plain ``.pth`` path line (which does not run this environment's own ``.pth`` files, so
the checkout is not importable through it). Each program checks values: the README's
torch program (jax blocked from importing), its JAX snippet (torch blocked), a per-token
finalize against the gradient divided by hand.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from launch import launch
from test_docs import README, blocks, floats

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("meshgrad", "torch_impl", "jax_impl", "parity_tests")  # pyproject.toml's [tool.setuptools]
TIMEOUT_S = 240


def blocker(*names: str) -> str:
    """Python source that makes importing any of ``names`` (and their submodules) fail,
    as if they were not installed."""
    return (
        "import sys\n"
        "class _Absent:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        f"        if name.split('.')[0] in {names!r}:\n"
        "            raise ModuleNotFoundError(f'No module named {name!r} (blocked by the test)')\n"
        "sys.meta_path.insert(0, _Absent())\n"
    )


def user_env() -> dict[str, str]:
    """A user's environment: no PYTHONPATH (nothing of the checkout), one OpenMP thread."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS")}
    env["OMP_NUM_THREADS"] = "1"
    return env


def run(cmd: list[str], cwd: Path) -> str:
    proc = subprocess.run(cmd, cwd=cwd, env=user_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, f"exit {proc.returncode}: {' '.join(map(str, cmd))}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def pip(*args: str) -> None:
    run([sys.executable, "-m", "pip", "-q", *args], ROOT)


def fresh_venv(path: Path) -> Path:
    """A venv without pip whose dependencies are this environment's; returns its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, timeout=TIMEOUT_S)
    python = path / "bin" / "python"
    site = Path(run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], path).strip())
    ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (site / "_test_dependencies.pth").write_text("".join(f"{p}\n" for p in sorted(ours)))
    return python


def beside_the_clone(tmp: Path) -> Path:
    """A folder holding a link named ``meshgrad`` to the checkout, as a script beside a
    clone called ``meshgrad`` sees it (the folder is a namespace-package candidate)."""
    folder = tmp / "work"
    folder.mkdir()
    (folder / "meshgrad").symlink_to(ROOT, target_is_directory=True)
    return folder


PER_TOKEN = """
import torch
import meshgrad, torch_impl
from meshgrad import FinalizeConfig
from torch_impl import finalize_model_grads

model = torch.nn.Linear(3, 2)
model.config = FinalizeConfig(calculate_per_token_loss=True)
model(torch.arange(12.0).reshape(4, 3)).sum().backward()
want = model.weight.grad / 4
finalize_model_grads([model], num_tokens=torch.tensor([4]))
print(torch.equal(model.weight.grad, want), meshgrad.__file__, torch_impl.__file__)
"""


def check_per_token(python: Path, cwd: Path, home: Path) -> None:
    """The per-token program run from ``cwd`` imports meshgrad and torch_impl from ``home``
    and divides the gradient by the token count."""
    (cwd / "per_token.py").write_text(PER_TOKEN)
    equal, *files = run([str(python), "per_token.py"], cwd).split()
    assert equal == "True"
    for name, file in zip(("meshgrad", "torch_impl"), files):
        assert Path(file).resolve() == (home / name / "__init__.py").resolve(), (name, file)


# --------------------------------------------------------------------------- wheel


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """meshgrad's wheel, built once from a copy of the packaged sources."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in PACKAGES:
        shutil.copytree(ROOT / name, src / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    pip("wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(tmp / "dist"), str(src))
    (found,) = (tmp / "dist").glob("meshgrad-*.whl")
    return found


@pytest.fixture(scope="module")
def wheel_venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with the wheel installed; returns its python."""
    python = fresh_venv(tmp_path_factory.mktemp("venv") / "venv")
    pip("--python", str(python), "install", "--no-deps", "--no-index", str(wheel))
    return python


def test_the_wheel_installs_only_the_designs_packages(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")} == set(PACKAGES)
    (top_level,) = [n for n in names if n.endswith(".dist-info/top_level.txt")]
    assert zipfile.ZipFile(wheel).read(top_level).decode().split() == sorted(PACKAGES)
    modules = {str(p.relative_to(ROOT)) for name in PACKAGES for p in (ROOT / name).rglob("*.py")}
    assert {n for n in names if n.endswith(".py")} == modules  # every subpackage too (torch_impl.audit, ...)
    (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
    requires = re.findall(r"^Requires-Dist: (.*)$", zipfile.ZipFile(wheel).read(metadata).decode(), re.M)
    core = [r for r in requires if "extra ==" not in r]
    assert core == ["numpy>=1.24"]  # the core needs numpy only
    assert not [r for r in requires if "==" in r.split(";")[0]], requires  # ranges, no exact pins


def test_wheel_runs_the_readme_torch_program_without_jax(wheel_venv: Path, tmp_path: Path) -> None:
    (snippet,) = blocks(README, "torchrun 2")
    script = tmp_path / "demo_torch.py"
    script.write_text(blocker("jax", "jaxlib", "flax", "optax", "chex") + snippet + "\nassert 'jax' not in sys.modules\n")
    out = launch([str(wheel_venv), "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script)],
                 tmp_path, TIMEOUT_S, env=user_env())
    reports = dict(re.findall(r"rank (\d+): (per-token -?[\d.]+, mean -?[\d.]+)", out))
    assert sorted(reports) == ["0", "1"], out
    assert reports["0"] == reports["1"]  # finalized: equal on both ranks
    assert all(v != 0 for v in floats(reports["0"]))


def test_wheel_runs_the_readme_jax_snippet_without_torch(wheel_venv: Path, tmp_path: Path) -> None:
    (snippet,) = blocks(README, "python")
    check = "\nimport jax_impl\nprint(jax_impl.__file__, 'torch' in sys.modules)\n"
    out = run([str(wheel_venv), "-c", blocker("torch") + snippet + check], tmp_path).split()
    diff, file, torch_loaded = out
    assert float(diff) <= 1e-6
    assert not Path(file).resolve().is_relative_to(ROOT) and torch_loaded == "False"


def test_wheel_install_is_not_shadowed_by_the_clone(wheel_venv: Path, tmp_path: Path) -> None:
    site = Path(run([str(wheel_venv), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                    tmp_path).strip())
    check_per_token(wheel_venv, beside_the_clone(tmp_path), site)
    out = run([str(wheel_venv), "-c", "import importlib.util as u; print(u.find_spec('bench'))"], tmp_path)
    assert out.strip() == "None"  # the benchmarks are not installed


# --------------------------------------------------------------------------- editable


def test_editable_install_imports_from_anywhere(tmp_path: Path) -> None:
    """``pip install -e .`` puts the checkout on sys.path (a path entry), so a script in a
    folder that holds the clone as ``meshgrad/`` imports the package, not the folder."""
    python = fresh_venv(tmp_path / "venv")
    pip("--python", str(python), "install", "--no-deps", "--no-build-isolation", "--no-index", "-e", str(ROOT))
    check_per_token(python, beside_the_clone(tmp_path), ROOT)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    check_per_token(python, elsewhere, ROOT)
