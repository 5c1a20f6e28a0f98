"""pyproject.toml's ranges against the exact versions in constraints/ (offline).

The library declares ranges so that it installs into other environments (NeMo-RL v0.7.0's); the standalone app's
exact versions live in constraints/{cpu,gpu}.txt. These tests keep the two consistent, and keep NeMo-RL's pins
inside our ranges, so that `pip install -c ...` can resolve (docs/install.md).
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
CONSTRAINTS = ROOT / "constraints"
# Linux x86_64 is where every one of these environments runs; markers are evaluated for it.
LINUX_X86 = {"sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix"}


def _project(text: str | None = None) -> dict:
    return tomllib.loads(text if text is not None else (ROOT / "pyproject.toml").read_text())["project"]


def _pins(path: Path) -> dict[str, Version]:
    """`name==version` lines of a constraints file; anything else there is an error."""
    pins: dict[str, Version] = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        req = Requirement(line)
        specs = list(req.specifier)
        assert len(specs) == 1 and specs[0].operator == "==", f"{path.name}: {line!r} is not an exact pin"
        name = canonicalize_name(req.name)
        assert name not in pins, f"{path.name}: {req.name} pinned twice"
        pins[name] = Version(specs[0].version)
    return pins


def _requirements(project: dict, extras: tuple[str, ...], python: str) -> list[Requirement]:
    """Requirements that apply on Linux x86_64 with `python` and `extras`."""
    env = {**default_environment(), **LINUX_X86, "python_version": ".".join(python.split(".")[:2]),
           "python_full_version": python}
    reqs = [Requirement(r) for r in project["dependencies"]]
    for extra in extras:
        reqs += [Requirement(r) for r in project["optional-dependencies"][extra]]
    return [r for r in reqs if r.marker is None or r.marker.evaluate({**env, "extra": ""})]


def exact_pins(project: dict) -> list[str]:
    """Library and machine-extra requirements that pin one version, or name no version at all."""
    reqs = list(project["dependencies"])
    for extra in ("cpu", "gpu"):
        reqs += project["optional-dependencies"][extra]
    bad = []
    for text in reqs:
        specs = list(Requirement(text).specifier)
        if not specs or any(s.operator in ("==", "===") and "*" not in s.version for s in specs):
            bad.append(text)
    return bad


def outside(project: dict, pins: dict[str, Version], extras: tuple[str, ...], python: str,
            require_all: bool = True) -> list[str]:
    """Requirements whose pinned version is not in our range (or, with require_all, that have no pin)."""
    problems = []
    for req in _requirements(project, extras, python):
        version = pins.get(canonicalize_name(req.name))
        if version is None:
            if require_all:
                problems.append(f"{req.name}: no pin")
        elif not req.specifier.contains(version, prereleases=True):
            problems.append(f"{req.name}: pinned {version}, range {req.specifier}")
    return problems


def test_library_dependencies_are_ranges():
    assert exact_pins(_project()) == []


# ids are file names: a bare "gpu" keyword would make conftest skip the test on machines without CUDA
@pytest.mark.parametrize("lock", ["cpu.txt", "gpu.txt"])
def test_app_constraints_lie_in_the_ranges(lock):
    """`make setup` installs `.[<device>,dev]` with -c constraints/<device>.txt: every package is pinned, in range."""
    device = lock.removesuffix(".txt")
    pins = _pins(CONSTRAINTS / lock)
    assert outside(_project(), pins, (device, "dev"), "3.11.7") == []


def test_nemo_rl_pins_lie_in_the_ranges():
    """Each package we name is in NeMo-RL v0.7.0's environment at a version our range admits (its gpu stack too)."""
    pins = _pins(CONSTRAINTS / "nemo_rl_v0.7.0.txt")
    assert outside(_project(), pins, ("gpu",), "3.13.13") == []
    stack = {"torch": "2.11.0", "vllm": "0.20.0", "transformers": "5.8.1", "megatron-core": "0.19.0"}
    assert {name: str(pins[name]) for name in stack} == stack


def test_requires_python_admits_nemo_rl_and_ours():
    spec = SpecifierSet(_project()["requires-python"])
    for python in ("3.11.7", "3.12.3", "3.13.13"):  # this app's venv, the H200 machine, NeMo-RL v0.7.0
        assert spec.contains(python), python


def test_checks_catch_exact_pins_and_narrow_ranges():
    """The checks above fail on a pyproject with exact pins and a requires-python that stops at 3.12."""
    old = _project("""[project]
requires-python = ">=3.11,<3.13"
dependencies = ["transformers==5.19.0", "numpy>=2.3,<3", "tqdm"]
[project.optional-dependencies]
cpu = ["torch==2.13.0"]
gpu = ["vllm>=0.26,<0.27"]
""")
    assert exact_pins(old) == ["transformers==5.19.0", "tqdm", "torch==2.13.0"]
    assert not SpecifierSet(old["requires-python"]).contains("3.13.13")
    nemo = {"transformers": Version("5.8.1"), "numpy": Version("2.4.4"), "tqdm": Version("4.67.3"),
            "vllm": Version("0.20.0")}
    assert outside(old, nemo, ("gpu",), "3.13.13") == ["transformers: pinned 5.8.1, range ==5.19.0",
                                                      "vllm: pinned 0.20.0, range <0.27,>=0.26"]
    assert outside(old, {}, (), "3.11.7") == ["transformers: no pin", "numpy: no pin", "tqdm: no pin"]
