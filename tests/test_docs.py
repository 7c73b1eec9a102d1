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


def command_page(name: str) -> Path:
    return ROOT / "docs" / "commands" / f"{name.replace(' ', '-')}.md"


def test_every_command_has_a_page_with_synopsis_options_and_example_linked_from_the_readme():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    missing = [c for c in COMMANDS if not command_page(c).is_file()]
    assert not missing, f"docs/commands/: no page for {missing}"
    for name in COMMANDS:
        page = command_page(name)
        body = page.read_text(encoding="utf-8")
        where = page.relative_to(ROOT)
        assert body.startswith(f"# `xformer {name}`\n"), f"{where}: does not open with its command"
        assert f"\nxformer {name} " in body, f"{where}: no synopsis"
        assert "| option |" in body, f"{where}: no options table"
        assert "```bash\n" in body, f"{where}: no example"
        assert f"]({where.as_posix()})" in readme, f"README.md: no link to {where}"
    strays = {p.stem for p in (ROOT / "docs" / "commands").glob("*.md")} - {c.replace(" ", "-") for c in COMMANDS}
    assert not strays, f"docs/commands/: pages of no command: {sorted(strays)}"


def slug(heading: str) -> str:
    """GitHub's anchor for a markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_every_relative_link_in_the_docs_reaches_a_file_and_heading():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), ROOT / "benchmarks" / "README.md"]
    broken = []
    for page in pages:
        text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.DOTALL)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and file.suffix == ".md":
                headings = re.findall(r"^#+ (.+)$", file.read_text(encoding="utf-8"), flags=re.MULTILINE)
                if anchor not in {slug(h) for h in headings}:
                    broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


SUMMARY_DATE = re.compile(r"\**\d{4}-\d{2}-\d{2}\**|not measured")  # a result's day, or none yet


def summary_problems(text: str) -> list[str]:
    """What keeps each `## ` benchmark of a results page from opening with a dated summary table:
    a table whose first header cell is `date`, before the first `###` other than `### Summary`,
    every data row dated (YYYY-MM-DD, possibly bold) or `not measured`."""
    text = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
    problems = []
    for section in re.split(r"^## ", text, flags=re.MULTILINE)[1:]:  # the text before is the preface
        name, _, body = section.partition("\n")
        opening = re.split(r"^### (?!Summary\s*$)", body, maxsplit=1, flags=re.MULTILINE)[0]
        lines = [line.strip() for line in opening.splitlines()]
        headers = [i for i, line in enumerate(lines) if re.match(r"\|\s*date\s*\|", line)]
        if not headers:
            problems.append(f"{name}: no summary table with a first column `date` before its first ###")
        for i in headers:
            rows = []
            for line in lines[i + 2:]:  # past the header and its |---| line
                if not line.startswith("|"):
                    break
                rows.append(line)
            if not rows:
                problems.append(f"{name}: the summary table has no rows")
            for row in rows:
                date = row.strip("|").split("|")[0].strip()
                if not SUMMARY_DATE.fullmatch(date):
                    problems.append(f"{name}: summary row not dated: {row[:80]}")
    return problems


def test_every_benchmark_in_results_opens_with_a_dated_summary_table():
    problems = summary_problems((ROOT / "docs" / "results.md").read_text(encoding="utf-8"))
    assert not problems, "docs/results.md:\n" + "\n".join(problems)


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
    from xformer.studies.ledger import ledger_problems

    monkeypatch.chdir(ROOT)  # the ledger names specs by their path from the checkout
    assert ledger_problems(Path("recipes/claims"), Path("docs/claims.md")) == []
    assert "[docs/claims.md](docs/claims.md)" in (ROOT / "README.md").read_text(encoding="utf-8")
