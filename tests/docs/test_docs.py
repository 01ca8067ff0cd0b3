"""The documentation stays inside the repository and matches the results it shows."""
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md"]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_every_relative_link_resolves_inside_the_repository():
    broken = []
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+://", target) or target.startswith("#"):
                continue
            path = (page.parent / target.split("#")[0]).resolve()
            if ROOT not in path.parents or not path.exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, broken


def test_no_page_points_outside_the_repository():
    outside = [f"{p.relative_to(ROOT)}:{i + 1}" for p in PAGES for i, line in enumerate(p.read_text().splitlines())
               if "../shared" in line]
    assert not outside, outside


def test_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250


def test_performance_page_is_generated_from_the_kept_results():
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "performance.py"), "--check"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
