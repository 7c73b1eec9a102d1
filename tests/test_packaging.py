import subprocess
import sys
from pathlib import Path

from xformer.config.loading import tomllib

ROOT = Path(__file__).resolve().parents[1]


def test_core_never_imports_typer_or_rich():
    code = "import sys, xformer, xformer.model, xformer.check; " \
           "print(sorted(m for m in ('typer', 'rich', 'click') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_core_sources_do_not_mention_the_cli_libraries():
    for path in (ROOT / "xformer").rglob("*.py"):
        text = path.read_text()
        assert "import typer" not in text and "from rich" not in text and "import rich" not in text, path


def test_every_package_folder_is_packaged():
    """pyproject lists packages by hand (cli/ installs as xformer_cli); a new folder must be added."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "xformer").rglob("__init__.py")}
    assert found | {"xformer_cli"} == listed


def test_ci_runs_exactly_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    command = readme.split("<!-- test-command -->", 1)[1].split("```bash\n", 1)[1].split("\n", 1)[0]
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert command in ci_lines
    assert "XFORMER_REQUIRE_SHARED=1" in "\n".join(ci_lines) and "XFORMER_REQUIRE_PEERS=1" in "\n".join(ci_lines)


def test_ci_installs_every_extra_pinned():
    """The export and peer tests need the peers extra, the tracker tests the trackers extra: CI
    installs them (and dev) under a
    constraints file that pins each of their packages, so no declared package's test skips there
    and no upstream release changes what they check unnoticed."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    command = (ROOT / "README.md").read_text().split("<!-- test-command -->", 1)[1].split("```bash\n", 1)[1]
    first = command.split("\n", 1)[0]
    assert '".[dev,peers,trackers]"' in first and "-c .ci/constraints.txt" in first
    pinned = {}
    for line in (ROOT / ".ci" / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            pinned[name.lower().replace("_", "-")] = version
    declared = [*project["dependencies"], *(r for extra in ("dev", "peers", "trackers")
                                            for r in project["optional-dependencies"][extra])]
    for requirement in declared:
        name = requirement.split(";")[0].split(">")[0].split("=")[0].split("<")[0].strip().lower()
        if name not in ("torch", "tomli"):  # torch: the CPU wheel .ci/run installs first; tomli: Python < 3.11
            assert name in pinned, requirement
