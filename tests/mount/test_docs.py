"""The documents against the tree, where a machine can check them (no mount needed):

- every option `kcachefs --help` lists is documented in the man page (doc/kcachefs.1), which
  renders without a warning and is installed by `meson install`;
- every script, source or binary of the tree that README.md's commands name (scripts/...,
  build/..., tests/..., /usr/local/bin/..., `python3 -m ...`), and every tree path quoted in
  README.md and doc/*.md, exists in the tree or is built by meson;
- every relative link of README.md and doc/*.md resolves, #anchors to headings included.

Each failure names the document and the line.
"""
import os
import re
import subprocess

from conftest import BUILD, KCACHEFS, REPO

MAN = REPO / "doc" / "kcachefs.1"
DOCS = [REPO / "README.md"] + sorted((REPO / "doc").glob("*.md"))
TOP_DIRS = ("scripts", "build", "tests", "python", "doc", "src")
FENCE = re.compile(r"^\s*(```|~~~)")


def rel(path):
    return path.relative_to(REPO)


def markdown_lines(path):
    """[(line number, text, in a fenced code block)] of a Markdown file; the fence lines
    count as in the block."""
    out, fenced = [], False
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            out.append((n, line, True))
            continue
        out.append((n, line, fenced))
    return out


def meson_executables():
    """{path under the build directory: installed?} of every executable meson.build files
    define (build/<name> at the top, build/<subdir>/<name> in a subdir)."""
    built = {}
    for mb in [REPO / "meson.build"] + sorted(REPO.glob("*/meson.build")):
        sub = mb.parent.relative_to(REPO)
        text = mb.read_text()
        for m in re.finditer(r"executable\(\s*'([^']+)'\s*,(.*?)\)\s*$", text, re.S | re.M):
            name = m.group(1)
            key = str(sub / name) if str(sub) != "." else name
            built[key] = "install : true" in m.group(2)
        # executable('test_' + t, ...) over a list: the names the loop makes
        for m in re.finditer(r"foreach t : (\w+|\[[^\]]*\])\s*\n\s*(?:\w+ = )?executable\('(\w+)' \+ t",
                             text):
            items = m.group(1)
            if not items.startswith("["):
                lm = re.search(r"%s = \[([^\]]*)\]" % items, text)
                items = lm.group(1) if lm else ""
            for t in re.findall(r"'(\w+)'", items):
                built[str(sub / (m.group(2) + t))] = False
    return built


BUILT = meson_executables()


def tree_path_problem(p):
    """None if the tree path p (relative, maybe with a glob) exists or meson builds it, else
    why not."""
    p = p.rstrip("/.,;:)")
    if p in TOP_DIRS:
        return None
    if p.startswith("build/"):
        target = p[len("build/"):]
        if target in BUILT or target in ("", "meson-logs"):
            return None
        return "%s is not an executable meson builds (it builds %s and build/tests/...)" % (
            p, ", ".join(sorted("build/" + t for t in BUILT if "/" not in t)))
    if any(ch in p for ch in "*?["):
        return None if list(REPO.glob(p)) else "%s matches no file of the tree" % p
    return None if (REPO / p).exists() else "%s is not in the tree" % p


def tokens(text):
    return [t for t in re.split(r"[\s=\"'`(){};|&<>]+", text) if t]


def path_in(token):
    """The tree-relative path a token names, or None: scripts/x, tests/x, ... at its start,
    or .../build/x (a clone's build tree anywhere)."""
    if token.split("/")[0] in TOP_DIRS and "/" in token:
        return token
    if "/build/" in token and not token.startswith("build/"):
        return token[token.index("/build/") + 1:]
    return None


def prose(path):
    """The text of a Markdown file with its fenced code blocks blanked (line numbers kept)."""
    return "\n".join("" if fenced else line for _, line, fenced in markdown_lines(path))


CODE_SPAN = re.compile(r"`([^`]+)`")  # may run over a line end, as in Markdown


def line_of(text, pos):
    return text.count("\n", 0, pos) + 1


def code_spans(path):
    """[(line number, text)] of the inline code spans of a Markdown file."""
    text = prose(path)
    return [(line_of(text, m.start()), m.group(1)) for m in CODE_SPAN.finditer(text)
            if "\n\n" not in m.group(1)]


def test_every_help_option_is_in_the_man_page():
    r = subprocess.run([str(KCACHEFS), "--help"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    text = MAN.read_text()
    o_options, dash_options = [], []
    for line in r.stdout.splitlines():
        m = re.match(r"^    -o (\w+)", line)
        if m:
            o_options.append(m.group(1))
            continue
        m = re.match(r"^    (-\w)(?:\s+(--[\w-]+))?", line)
        if m:
            dash_options += [o for o in m.groups() if o]
    assert len(o_options) >= 20 and {"-f", "-d", "-s", "--help", "--version"} <= set(dash_options), \
        "kcachefs --help changed its layout; this test reads it:\n" + r.stdout
    missing = ["-o " + o for o in o_options
               if not re.search(r"^\.(B|BI|BR) (\\-o )?%s\b" % re.escape(o), text, re.M)]
    missing += [o for o in dash_options
                if not re.search(r"^\.(B|BI|BR) .*(?<![\w-])%s\b" % re.escape(o.replace("-", "\\-")),
                                 text, re.M)]
    assert not missing, "%s: options of kcachefs --help with no .B/.BI/.BR line: %s" % (
        rel(MAN), ", ".join(missing))


def test_the_man_page_renders_cleanly_and_is_installed(tmp_path):
    text = MAN.read_text()
    for section in ("SYNOPSIS", "OPTIONS", "THE ON-DISK CONTRACT", "FILES", "EXIT STATUS",
                    "EXAMPLES", ".kcachefs/stats", ".kcachefs/metrics.prom"):
        assert section in text, "%s has no %s" % (rel(MAN), section)
    r = subprocess.run(["groff", "-man", "-ww", "-z", str(MAN)], capture_output=True, text=True)
    assert r.returncode == 0 and r.stderr == "", "%s: groff says %s" % (rel(MAN), r.stderr)
    # meson install puts it where man finds it.
    r = subprocess.run(["meson", "install", "-C", str(BUILD), "--destdir", str(tmp_path),
                        "--no-rebuild", "--quiet"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert list(tmp_path.rglob("share/man/man1/kcachefs.1*")), list(tmp_path.rglob("*"))


def test_readme_commands_name_what_the_tree_has():
    """Each command line of README.md's code blocks: the scripts, sources and build outputs
    it names exist or are built, /usr/local/bin/X is an installed program, a bare program
    of the tree is one meson builds, and python3 -m X runs a package of python/."""
    readme = REPO / "README.md"
    problems, checked = [], 0
    installed = {name for name, inst in BUILT.items() if inst and "/" not in name}
    for n, line, fenced in markdown_lines(readme):
        if not fenced:
            continue
        command = line.split(" #")[0]  # a shell comment is prose
        words = tokens(command)
        for i, w in enumerate(words):
            p = path_in(w)
            why = None
            if p:
                why = tree_path_problem(p)
                if not why and i == 0 and p.startswith("scripts/") and \
                        not os.access(REPO / p, os.X_OK):
                    why = "%s is run as a command but is not executable" % p
            elif w.startswith("/usr/local/bin/"):
                p = w
                if w[len("/usr/local/bin/"):] not in installed:
                    why = "%s: meson installs no such program (it installs %s)" % (
                        w, ", ".join(sorted(installed)))
            elif i == 0 and w.startswith("kcachefs"):
                p = w
                if w not in installed:
                    why = "%s is not a program meson installs" % w
            elif w == "-m" and i > 0 and words[i - 1].startswith("python") and i + 1 < len(words):
                p = "python/" + words[i + 1].replace(".", "/")
                if not (REPO / p / "__main__.py").exists():
                    why = "python -m %s: %s/__main__.py is not in the tree" % (words[i + 1], p)
            if p:
                checked += 1
            if why:
                problems.append("%s:%d: %s\n    %s" % (rel(readme), n, why, line.strip()))
    assert checked >= 5, "only %d commands of README.md name something of the tree" % checked
    assert not problems, "\n".join(problems)


def test_tree_paths_quoted_in_the_documents_exist():
    """A path of the tree quoted in any document (`scripts/x`, `src/x.c`, `build/x`, ...)
    names a file or directory that is there, or a program meson builds."""
    problems, checked = [], 0
    for doc in DOCS:
        blocks = [(n, line) for n, line, fenced in markdown_lines(doc) if fenced]
        for n, span in blocks + code_spans(doc):
            for w in tokens(span):
                p = path_in(w)
                if not p or "<" in p:  # <clone>/python: a placeholder, not a path
                    continue
                checked += 1
                why = tree_path_problem(p)
                if why:
                    problems.append("%s:%d: %s" % (rel(doc), n, why))
    assert checked >= 50, "only %d tree paths found in the documents" % checked
    assert not problems, "\n".join(problems)


def slug(heading):
    """GitHub's anchor of a Markdown heading."""
    s = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return s.replace(" ", "-")


def anchors(path):
    found, seen = set(), {}
    for _, line, fenced in markdown_lines(path):
        m = re.match(r"^#{1,6} (.+?)\s*#*$", line)
        if m and not fenced:
            base = slug(m.group(1))
            k = seen.get(base, 0)
            seen[base] = k + 1
            found.add(base if k == 0 else "%s-%d" % (base, k))
    return found


def test_relative_links_resolve():
    problems, checked = [], 0
    for doc in DOCS:
        # code spans blanked (their newlines kept): a link is never inside one
        text = CODE_SPAN.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), prose(doc))
        for m in re.finditer(r"\]\(([^)\s]+)\)", text):
            target, n = m.group(1), line_of(text, m.start())
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                continue
            checked += 1
            path, _, anchor = target.partition("#")
            dest = (doc.parent / path).resolve() if path else doc
            if not dest.exists():
                problems.append("%s:%d: link %s: %s does not exist" % (rel(doc), n, target, path))
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                problems.append("%s:%d: link %s: no heading of %s has the anchor #%s" % (
                    rel(doc), n, target, rel(dest), anchor))
    assert checked >= 20, "only %d relative links found" % checked
    assert not problems, "\n".join(problems)


def test_testing_guide_describes_every_mount_test_file():
    guide = REPO / "doc" / "testing.md"
    # (a name after a slash is another project's: DeepGEMM's tests/test_bf16.py)
    named = set(re.findall(r"(?<![/\w])test_\w+\.py\b", guide.read_text()))
    files = {p.name for p in (REPO / "tests" / "mount").glob("test_*.py")}
    assert not named - files, "%s names mount test files that are not in tests/mount: %s" % (
        rel(guide), ", ".join(sorted(named - files)))
    assert not files - named, "%s does not describe these mount test files: %s" % (
        rel(guide), ", ".join(sorted(files - named)))


def test_the_redis_acl_grants_are_the_ones_the_unit_test_runs_with():
    """doc/cluster.md's ACL grants are exactly those the Redis backend's unit test gives a
    user that then takes, peeks, renews and releases a held lease and sends a notice: a
    command added to the backend or its scripts without a grant in the guide fails here or
    there."""
    unit = (REPO / "tests/unit/test_remote_redis.c").read_text()
    grants = re.search(r'#define DOC_GRANTS "([^"]+)"', unit).group(1)
    guide = " ".join((REPO / "doc/cluster.md").read_text().split())
    assert f"`{grants}`" in guide, f"doc/cluster.md does not list the grants {grants!r}"
