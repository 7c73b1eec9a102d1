"""The product speaks to users: no work-log words in what ships, and the README is a manual.

Scanned: README.md, docs/, recipes/, xformer/, cli/, benchmarks/ (every .md .py .toml .sh .txt).
tests/ is not scanned, and the patterns below are built from pieces so this file never matches
itself.
"""

import re
from pathlib import Path

from xformer_cli.main import app

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ["README.md", "docs", "recipes", "xformer", "cli", "benchmarks"]
SUFFIXES = {".md", ".py", ".toml", ".sh", ".txt"}
FORBIDDEN = [
    re.compile("sess" + r"ion\s*\d+", re.IGNORECASE),  # a work session's number: say the date
    re.compile("iss" + r"ue\s*#?\d+", re.IGNORECASE),  # a tracker number: say what it is about
    re.compile("the main " + "job", re.IGNORECASE),  # say what the command does
]
COMMANDS = ([command.name for command in app.registered_commands]  # every command the CLI has
            + [f"{group.name} {command.name}" for group in app.registered_groups
               for command in group.typer_instance.registered_commands])


def scanned_files() -> list[Path]:
    files = []
    for name in SCANNED:
        path = ROOT / name
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            files += [p for p in path.rglob("*") if p.is_file() and p.suffix in SUFFIXES
                      and "__pycache__" not in p.parts]
    return sorted(files)


def test_no_session_issue_or_main_job_mentions():
    hits = []
    for path in scanned_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        for number, line in enumerate(text.splitlines(), 1):
            if any(pattern.search(line) for pattern in FORBIDDEN):
                hits.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not hits, "work-log words in the product:\n" + "\n".join(hits)


def readme_sections() -> dict[str, str]:
    """README's `### `xformer NAME`` sections, by command name."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    parts = re.split(r"^### `xformer ([a-z-]+(?: [a-z-]+)?)`[^\n]*$", text, flags=re.MULTILINE)
    return {name: body.split("\n## ", 1)[0] for name, body in zip(parts[1::2], parts[2::2], strict=True)}


def test_readme_has_a_section_with_synopsis_options_and_example_per_command():
    sections = readme_sections()
    missing = [c for c in COMMANDS if c not in sections]
    assert not missing, f"README.md: no section for {missing}"
    for name in COMMANDS:
        body = sections[name]
        assert f"\nxformer {name} " in body, f"README.md, xformer {name}: no synopsis"
        assert "| option |" in body, f"README.md, xformer {name}: no options table"
        assert "```bash\n" in body, f"README.md, xformer {name}: no example"


def test_readme_names_no_path_beside_the_checkout():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "../shared" not in readme, "README.md: use a placeholder such as PATH/TO/multi30k"


def test_every_recipe_header_says_what_command_result_and_hardware():
    problems = []
    for path in sorted((ROOT / "recipes").rglob("*.toml")):
        header = []
        for line in path.read_text(encoding="utf-8").splitlines():
            if not line.startswith("#"):
                break
            header.append(line)
        labels = {m.group(1) for line in header if (m := re.match(r"# (\w+):", line))}
        text = path.read_text(encoding="utf-8")
        blocked = "[claim]" in text and "[experiment]" not in text  # a claim xformer cannot measure yet
        if blocked and not any(line.startswith("# Not measurable yet:") for line in header):
            problems.append(f"{path.relative_to(ROOT)}: no '# Not measurable yet:' line in the claim's header")
        for needed in ((("Claim",),) if blocked else (("Train", "Run"), ("Result",), ("Hardware",))):
            if not labels.intersection(needed):
                problems.append(f"{path.relative_to(ROOT)}: no '# {needed[0]}:' line in the header")
    assert not problems, "\n".join(problems)


def test_the_claims_ledger_is_what_its_specs_and_records_generate(monkeypatch):
    """docs/claims.md is generated (`xformer claims`), never edited: regenerated from
    recipes/claims/ and the records in docs/claims/, it comes out the same."""
    from xformer.ledger import ledger_problems

    monkeypatch.chdir(ROOT)  # the ledger names specs by their path from the checkout
    assert ledger_problems(Path("recipes/claims"), Path("docs/claims.md")) == []
    assert "[docs/claims.md](docs/claims.md)" in (ROOT / "README.md").read_text(encoding="utf-8")
