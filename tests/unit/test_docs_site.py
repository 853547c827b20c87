"""The README is a front door and the docs site builds: `make docs`'s strict build passes offline
(a broken link or anchor between pages fails it), the README's own links reach real files and
headings, and every section of the manual the README used to be has a page."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from markdown.extensions.toc import slugify

from plait.tools.docs_hooks import pages_in_reading_order, unescape_table_code_pipes
from tests.doc_blocks import DOCS, README, ROOT

_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)


def build_site(site: Path, config: Path = ROOT / "mkdocs.yml") -> subprocess.CompletedProcess:
    """`mkdocs build --strict`, as `make docs` runs it, into `site`."""
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=config.parent,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )


def small_site(root: Path, pages: dict[str, str]) -> Path:
    """A docs/ of `pages` under `root`, with plait's mkdocs.yml (and hooks) beside it."""
    for name, text in pages.items():
        (root / "docs" / name).parent.mkdir(parents=True, exist_ok=True)
        (root / "docs" / name).write_text(text)
    hooks = str(ROOT / "tools" / "docs_hooks.py")
    config = root / "mkdocs.yml"
    config.write_text((ROOT / "mkdocs.yml").read_text().replace("tools/docs_hooks.py", hooks))
    return config


def nav_of(site: Path) -> list[str]:
    """The page links of a built site's navigation, in order."""
    html = (site / "index.html").read_text()
    links = re.findall(r'<a href="([^"#]*)" class="md-nav__link', html)
    return list(dict.fromkeys(links))


def heading_slugs(text: str) -> set[str]:
    """The anchors of a page's headings, as mkdocs (Python-Markdown's toc) and GitHub make them."""
    slugs = set()
    for line in _FENCE.sub("", text).splitlines():
        if match := re.match(r"^#{1,6} (.+)$", line):
            slugs.add(slugify(re.sub(r"[`*]", "", match.group(1)), "-"))
    return slugs


def broken_links(markdown_file: Path) -> list[str]:
    """Relative links of a Markdown file whose file, or heading, does not exist."""
    text = markdown_file.read_text()
    broken = []
    for target in _LINK.findall(_FENCE.sub("", text)):
        if re.match(r"^[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        resolved = (markdown_file.parent / path).resolve() if path else markdown_file
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif (
            anchor
            and resolved.suffix == ".md"
            and anchor not in heading_slugs(resolved.read_text())
        ):
            broken.append(f"{target}: no heading #{anchor} in {resolved.name}")
    return broken


@pytest.mark.timeout(120)
def test_the_site_builds_strict_and_offline(tmp_path: Path) -> None:
    pytest.importorskip("material", reason="mkdocs-material is in the docs and dev extras")
    result = build_site(tmp_path / "site")
    assert result.returncode == 0, result.stdout + result.stderr
    for page in DOCS.rglob("*.md"):
        relative = page.relative_to(DOCS).with_suffix("")
        built = tmp_path / "site" / ("" if relative.name == "index" else relative) / "index.html"
        assert built.exists(), f"{page.name} is not in the site"
    # Nothing the pages need is fetched when they are read: no fonts, scripts or styles from
    # the network (an offline GPU node reads the same site).
    for html in (tmp_path / "site").rglob("*.html"):
        remote = re.findall(
            r'<(?:script|link)[^>]+(?:src|href)="(https?://[^"]+)"', html.read_text()
        )
        assert not remote, f"{html.relative_to(tmp_path)} loads {remote}"


@pytest.mark.timeout(120)
def test_a_broken_link_between_pages_fails_the_build(tmp_path: Path) -> None:
    """The strict build is what catches broken links: a page linking to a missing page, and one
    linking to a missing heading, fail it."""
    pytest.importorskip("material", reason="mkdocs-material is in the docs and dev extras")
    config = small_site(
        tmp_path,
        {
            "index.md": "# Home\n\nSee [the missing page](missing.md).\n",
            "other.md": "# Other\n\nSee [a heading](index.md#no-such-heading).\n",
        },
    )
    result = build_site(tmp_path / "site", config)
    assert result.returncode != 0
    assert "missing.md" in result.stderr and "no-such-heading" in result.stderr, result.stderr


@pytest.mark.timeout(120)
def test_a_new_page_is_in_the_navigation_and_a_named_absent_one_is_not_needed(
    tmp_path: Path,
) -> None:
    """No page is listed by hand: one nobody named joins the navigation after the named ones,
    and the named pages that are absent (here all but two) do not fail the strict build."""
    pytest.importorskip("material", reason="mkdocs-material is in the docs and dev extras")
    config = small_site(
        tmp_path,
        {"index.md": "# Home\n", "a-new-topic.md": "# New\n", "training.md": "# Training\n"},
    )
    result = build_site(tmp_path / "site", config)
    assert result.returncode == 0, result.stdout + result.stderr
    assert nav_of(tmp_path / "site") == [".", "training/", "a-new-topic/"]


def test_the_navigation_follows_the_reading_order_then_the_file_names(tmp_path: Path) -> None:
    for name in ("cli.md", "index.md", "zz.md", "training.md", "sub/page.md", ".draft.md"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("# x\n")
    assert pages_in_reading_order(tmp_path) == [
        "index.md",
        "training.md",
        "cli.md",
        "sub/page.md",
        "zz.md",
    ]


def test_every_relative_link_of_the_readme_and_the_pages_resolves() -> None:
    for markdown_file in [README, *DOCS.rglob("*.md")]:
        assert not broken_links(markdown_file), (markdown_file.name, broken_links(markdown_file))


def test_the_link_check_sees_a_missing_file_and_a_missing_heading(tmp_path: Path) -> None:
    (tmp_path / "a.md").write_text("# A\n\n## Some `code` heading\n")
    page = tmp_path / "README.md"
    page.write_text(
        "[ok](a.md#some-code-heading) [file](b.md) [heading](a.md#nope) [web](https://x.org)\n"
        "```\n[in code](c.md)\n```\n"
    )
    assert broken_links(page) == ["b.md: no such file", "a.md#nope: no heading #nope in a.md"]


def test_the_readme_is_a_front_door() -> None:
    """Short, with `make demo` and `make test` as its first commands, both real targets, and
    `make test` what CI runs."""
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    first_block = re.search(r"```bash\n(.*?)```", text, re.DOTALL).group(1)
    commands = [line.split("#")[0].strip() for line in first_block.splitlines()]
    assert commands == ["make demo", "make test"]
    makefile = (ROOT / "Makefile").read_text()
    for target in ("demo", "test", "docs"):
        assert re.search(rf"^{target}:", makefile, re.MULTILINE), target
        assert target in re.search(r"^\.PHONY:(.*)$", makefile, re.MULTILINE).group(1).split()
    assert "make test" in (ROOT / ".ci" / "run").read_text()


# Every section of the README before it became a front door, and the page that holds it now.
OLD_README_SECTIONS = {
    "Quickstart": "training.md",
    "Your own model: a Hugging Face `transformers` model, your own loop": "your-own-model.md",
    "Hugging Face checkpoints": "your-own-model.md",
    "Training on documents": "training.md",
    "Nodes: the host map and cross-node bytes": "parallelisms.md",
    "Sharded data parallelism across nodes (HSDP)": "parallelisms.md",
    "How a step runs": "how-a-step-runs.md",
    "Compiled blocks": "how-a-step-runs.md",
    "Triton tiles, tuned per GPU": "how-a-step-runs.md",
    "Kernel providers chosen by measurement": "how-a-step-runs.md",
    "Context parallelism": "parallelisms.md",
    "Mixture of experts and expert parallelism": "parallelisms.md",
    "FLOPs and MFU": "how-a-step-runs.md",
    "Planning a layout": "planning.md",
    "Writing a plugin": "plugins.md",
    "A strategy: `plait_shard`": "plugins.md",
    "A schedule: `plait_schedule`": "plugins.md",
    "A kernel provider: `plait_kernel`": "plugins.md",
    "A communication algorithm: `plait_communicate`": "plugins.md",
    "How a plugin learns its configuration": "plugins.md",
    "Describing your strategy's state": "plugins.md",
    "Packaging and installing": "plugins.md",
    "Testing a plugin": "plugins.md",
    "CLI reference": "cli.md",
    "Live MFU and the node daemon": "daemon.md",
    "Bottlenecks, stragglers and hangs": "daemon.md",
    "Profiling on demand: traces, stacks, memory": "daemon.md",
    "Exporters and GPUs": "daemon.md",
    "Ingest on more than one core": "daemon.md",
    "Security": "daemon.md",
    "Watching a job plait did not launch": "observe.md",
    "Telemetry schema": "telemetry-schema.md",
    "Installing on an offline GPU node": "gpu-nodes.md",
    "Checking a GPU node": "gpu-nodes.md",
    "Layout": "layout.md",
    "Benchmarks": "benchmarks.md",
}


def test_every_section_of_the_old_readme_has_a_heading_on_its_page() -> None:
    missing = [
        f"{heading} ({name})"
        for heading, name in OLD_README_SECTIONS.items()
        if not re.search(rf"^#+ {re.escape(heading)}$", (DOCS / name).read_text(), re.MULTILINE)
    ]
    assert not missing, missing


def test_the_hook_unescapes_pipes_only_in_table_code_spans() -> None:
    text = "| `a N\\|M` | b \\| c |\n`x\\|y`\n```\n| `q\\|r` |\n```"
    assert (
        unescape_table_code_pipes(text) == "| `a N|M` | b \\| c |\n`x\\|y`\n```\n| `q\\|r` |\n```"
    )
