"""The documents: no development history, links that resolve, commands that exist.

Three checks over README.md and docs/**/*.md (and, for the first, the comments and
strings of every Python file of the project):

* no development history: the project speaks of itself, not of how it got here
  (`HISTORY_PATTERNS`; a legitimate use is allowed by its exact text in `ALLOWED`);
* every relative link `[text](path)` / `[text](path#anchor)` resolves to a file or folder,
  and an anchor to a heading of that file by GitHub's slug rules; a results page that an
  experiment writes and has not written yet may be linked only when it is listed in
  `PAGES_WRITTEN_BY_EXPERIMENTS` with the script that writes it;
* every quoted `python -m pipe_rlhf_jax.<module> ...` and `python -m experiments.<script>
  ...` names an entry point that exists, and every `--flag` it passes is one that entry
  point defines: its `--helpfull` (absl) or `--help` (argparse) output, run once per
  entry point (the argparse ones in one interpreter, so that jax is imported once); a
  script quoted by its path (`python experiments/<script>.py`) is a mistake, since the
  scripts are modules of the `experiments` package;
  `--config.<field>` overrides name a field of configs/quickstart.py's `get_config()`,
  which every shipped config starts from;
* the vocabulary's retired names (docs/vocabulary.md, "Retired names") appear nowhere:
  no identifier, module or import of the project's Python files, and no config key of
  the shipped configs or of a quoted command.
"""

from __future__ import annotations

import ast
import functools
import io
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import tokenize

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

# ---- 1. No development history -------------------------------------------------------

HISTORY_PATTERNS = [re.compile(p, re.IGNORECASE) for p in (
    r"\bstop \d+\b",
    r"\bstop-\d+\b",
    r"\b(this|that|the previous|previous|an earlier|a later|the next) stop\b",
    r"\bstop's\b",
    r"\bthis\s+host\b",
    r"\bissue #?\d+",
    r"\bthe issue's\b",
    r"\bsession\b",  # a word of its own: not `start_new_session` or `SessionLog`
    r"\bround-by-round\b",
    r"\bprevious README\b",
    r"\bdevelopment (run|machine|host)s?\b",
)]

# (path, text the line contains): legitimate uses, one by one. None today; an entry
# names one line's text exactly, never a whole file.
ALLOWED: set[tuple[str, str]] = set()

PYTHON_DIRS = ("pipe_rlhf_jax", "configs", "experiments", "tests")


def markdown_files() -> list[pathlib.Path]:
  return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def python_files() -> list[pathlib.Path]:
  return [p for d in PYTHON_DIRS for p in sorted((ROOT / d).rglob("*.py"))]


def prose_of_python(path: pathlib.Path) -> list[tuple[int, str]]:
  """(line number, text) of every comment and string literal of a Python file."""
  out = []
  source = path.read_text(encoding="utf-8")
  for tok in tokenize.generate_tokens(io.StringIO(source).readline):
    if tok.type in (tokenize.COMMENT, tokenize.STRING):
      for i, line in enumerate(tok.string.splitlines()):
        out.append((tok.start[0] + i, line))
  return out


def shown(path: pathlib.Path) -> str:
  """A path as problems name it: relative to the repository when it lies inside."""
  return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)


def history_hits(path: pathlib.Path, lines: list[tuple[int, str]],
                 allowed: set[tuple[str, str]] = ALLOWED) -> list[str]:
  rel = shown(path)
  hits = []
  for number, text in lines:
    for pattern in HISTORY_PATTERNS:
      for match in pattern.finditer(text):
        if any(rel == p and exact in text for p, exact in allowed):
          continue
        hits.append(f"{rel}:{number}: {match.group(0)!r} in {text.strip()[:100]!r}")
  return hits


def test_no_development_history_in_documents_comments_or_strings():
  hits = []
  for path in markdown_files():
    lines = list(enumerate(path.read_text(encoding="utf-8").splitlines(), start=1))
    hits += history_hits(path, lines)
  for path in python_files():
    hits += history_hits(path, prose_of_python(path))
  assert not hits, ("development history (keep it in the git log; say what the project "
                    "does and why, with the command that measures it):\n"
                    + "\n".join(hits))


def test_the_history_check_flags_what_it_should_and_nothing_else():
  # Written with a "~" that is removed here, so that this file holds no history itself.
  flagged = [t.replace("~", "") for t in (
      "at st~op 22's code", "on this ~host", "(issue~ 11)", "issue ~#9's comparison",
      "in this ses~sion", "st~op-25", "the previous st~op's table", "round~-by-round",
      "a develop~ment run gave", "the iss~ue's target")]
  kept = ["stop_step = 3", "StopRequest", "start_new_session=True", "SessionLog.START",
          "stops at step 3", "a signal stops at once", "the host's cores",
          "the local host", "a PPO step", "issues every transfer", "the stop step"]
  path = ROOT / "pipe_rlhf_jax" / "launch.py"  # any project path: only its name is shown
  for text in flagged:
    assert history_hits(path, [(1, text)]), text
  for text in kept:
    assert not history_hits(path, [(1, text)]), text
  # An allowed line is allowed in its own file only.
  line = flagged[4]
  allowed = {("pipe_rlhf_jax/launch.py", line)}
  assert not history_hits(path, [(1, line)], allowed)
  assert history_hits(ROOT / "README.md", [(1, line)], allowed)


# ---- 2. Links ------------------------------------------------------------------------

# docs/results/ pages that experiment scripts write (`experiments/results.py`'s
# `write_page`): a guide may link one before its first run has written it.
PAGES_WRITTEN_BY_EXPERIMENTS = {
    "docs/results/fault_matrix.md": "experiments.fault_matrix",
    "docs/results/learning_curves.md": "experiments.learning_curves",
    "docs/results/planner_accuracy.md": "experiments.planner_accuracy",
    "docs/results/planner_user_path.md": "experiments.planner_user_path",
    "docs/results/ppo_step.md": "experiments.bench_ppo_step",
    "docs/results/modes.md": "experiments.bench_modes",
    "docs/results/memory.md": "experiments.bench_memory",
    "docs/results/peer_tunix.md": "experiments.side_by_side_tunix",
    "docs/results/decode_weights.md": "experiments.bench_decode_weights",
    "docs/results/real_shapes.md": "experiments.bench_ppo_step",
}

FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.M | re.S)
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})[ \t]+(.+?)[ \t#]*$", re.M)


def without_code(text: str) -> str:
  """The markdown with fenced blocks and inline code blanked (links there are text)."""
  text = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
  return INLINE_CODE.sub(lambda m: " " * len(m.group(0)), text)


def github_slug(heading: str) -> str:
  """The anchor GitHub gives a heading: its text lowercased, punctuation dropped (letters,
  digits, '-', '_' and spaces kept), spaces turned into '-'."""
  text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
  text = re.sub(r"<[^>]+>", "", text).replace("`", "")
  text = text.strip().lower()
  text = re.sub(r"[^\w\- ]", "", text, flags=re.UNICODE)
  return text.replace(" ", "-")


def anchors_of(path: pathlib.Path) -> set[str]:
  seen: dict[str, int] = {}
  anchors = set()
  for match in HEADING.finditer(FENCE.sub("", path.read_text(encoding="utf-8"))):
    slug = github_slug(match.group(2))
    count = seen.get(slug, 0)
    seen[slug] = count + 1
    anchors.add(slug if count == 0 else f"{slug}-{count}")
  return anchors


def link_problems(path: pathlib.Path) -> list[str]:
  rel = shown(path)
  problems = []
  text = without_code(path.read_text(encoding="utf-8"))
  for match in LINK.finditer(text):
    target = match.group(1)
    if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
      continue
    line = text.count("\n", 0, match.start()) + 1
    where, _, anchor = target.partition("#")
    file = (path.parent / where).resolve() if where else path
    key = shown(file)
    if not file.exists():
      if key in PAGES_WRITTEN_BY_EXPERIMENTS and not anchor:
        continue  # checked by test_pages_written_by_experiments_have_their_script
      problems.append(f"{rel}:{line}: link to {target!r}: no such file ({key})"
                      + (" (a page written by an experiment is linked without an anchor)"
                         if key in PAGES_WRITTEN_BY_EXPERIMENTS else ""))
      continue
    if anchor and (file.is_dir() or file.suffix != ".md"):
      problems.append(f"{rel}:{line}: link to {target!r}: an anchor into a non-markdown "
                      "file")
    elif anchor and anchor not in anchors_of(file):
      problems.append(f"{rel}:{line}: link to {target!r}: {key} has no heading "
                      f"#{anchor} (it has: {', '.join(sorted(anchors_of(file)))})")
  return problems


def test_relative_links_resolve_to_files_and_headings():
  problems = [p for path in markdown_files() for p in link_problems(path)]
  assert not problems, "broken links:\n" + "\n".join(problems)


def test_pages_written_by_experiments_have_their_script():
  for page, script in PAGES_WRITTEN_BY_EXPERIMENTS.items():
    path = entry_point_file(script)
    assert path is not None, f"{page}: its script {script} does not exist"
    stem = pathlib.Path(page).stem
    assert re.search(rf"(?<![A-Za-z0-9]){re.escape(stem)}(?![A-Za-z0-9])",
                     path.read_text(encoding="utf-8")), (
        f"{page}: {script} never mentions {stem!r}, so it cannot be the script writing it")


PICTURES = (".png", ".svg", ".jpg", ".jpeg", ".gif")


def test_every_picture_under_docs_is_shown_by_a_document():
  # A picture no page shows cannot say which command made it, and goes stale unseen.
  # docs/results/ belongs to the experiment scripts that write it.
  shown = set()
  for path in markdown_files():
    for match in LINK.finditer(without_code(path.read_text(encoding="utf-8"))):
      target = match.group(1).partition("#")[0]
      if target and not re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):
        shown.add((path.parent / target).resolve())
  docs = ROOT / "docs"
  unshown = sorted(p.relative_to(ROOT).as_posix() for p in docs.rglob("*")
                   if p.suffix.lower() in PICTURES and p.resolve() not in shown
                   and p.relative_to(docs).parts[0] != "results")
  assert not unshown, ("pictures no document shows (show them, with the command that "
                       "makes them, or remove them):\n" + "\n".join(unshown))


def test_github_slugs():
  assert github_slug("Learning curves across modes and seeds") == (
      "learning-curves-across-modes-and-seeds")
  assert github_slug("`plan.choose=auto` and projections") == "planchooseauto-and-projections"
  assert github_slug("SIGINT / SIGTERM during PPO") == "sigint--sigterm-during-ppo"
  assert github_slug("PPO-ptx (the SFT term)") == "ppo-ptx-the-sft-term"


# ---- 3. Quoted commands ---------------------------------------------------------------

COMMAND = re.compile(
    r"python3?\s+(?:-m\s+((?:pipe_rlhf_jax|experiments)(?:\.\w+)+)|(experiments/\w+\.py))")
# Where a quoted command ends: a shell operator, a comment, a closing quote or bracket.
END_OF_COMMAND = re.compile(r"\s(?:&&|\|\||;|\||#)|[\"`]|$")


def code_snippets(text: str) -> list[tuple[int, str]]:
  """(line, text) of each fenced block's commands (backslash continuations joined) and of
  each inline code span (which may wrap over lines)."""
  out = []
  for match in FENCE.finditer(text):
    start = text.count("\n", 0, match.start()) + 1
    body = match.group(0).split("\n")[1:-1]
    joined, first = "", None
    for i, line in enumerate(body):
      first = start + 1 + i if first is None else first
      if line.rstrip().endswith("\\"):
        joined += line.rstrip()[:-1] + " "
        continue
      out.append((first, joined + line))
      joined, first = "", None
  rest = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
  for match in INLINE_CODE.finditer(rest):
    out.append((rest.count("\n", 0, match.start()) + 1,
                match.group(0).strip("`").replace("\n", " ")))
  return out


def quoted_commands(path: pathlib.Path) -> list[tuple[int, str, list[str]]]:
  """(line, entry point, arguments) of each command quoted in a markdown file."""
  commands = []
  for line, snippet in code_snippets(path.read_text(encoding="utf-8")):
    for match in COMMAND.finditer(snippet):
      tail = snippet[match.end():]
      end = END_OF_COMMAND.search(tail)
      commands.append((line, match.group(1) or match.group(2),
                       tail[:end.start()].split() if end else tail.split()))
  return commands


def entry_point_file(entry: str) -> pathlib.Path | None:
  """The file of module `entry` (`pipe_rlhf_jax.main`, `experiments.bench_modes`); None for
  a module that does not exist and for a script's path (`experiments/x.py`), which is not
  how an entry point runs."""
  if "/" in entry:
    return None
  base = ROOT.joinpath(*entry.split("."))
  for path in (base.with_suffix(".py"), base / "__main__.py"):
    if path.is_file():
      return path
  return None


def _declared_argparse_flags(source: str) -> set[str]:
  """The `--flags` a script's source declares to argparse (`add_argument("--x", ...)`)."""
  flags = set()
  for node in ast.walk(ast.parse(source)):
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
        and node.func.attr == "add_argument"):
      flags |= {a.value[2:] for a in node.args
                if isinstance(a, ast.Constant) and isinstance(a.value, str)
                and a.value.startswith("--")}
  return flags


def _is_absl(source: str) -> bool:
  return "from absl import app" in source


# Runs `--help` of several argparse entry points in one interpreter, so that jax, which
# most of them import first, is imported once: argv[1] is a JSON list of module names,
# argv[2] where the help texts go (JSON).
_HELP_RUNNER = r"""
import contextlib, io, json, runpy, sys
todo, where, out = json.loads(sys.argv[1]), sys.argv[2], {}
for entry in todo:
  buf = io.StringIO()
  sys.argv = [entry, "--help"]
  try:
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
      runpy.run_module(entry, run_name="__main__", alter_sys=True)
    out[entry] = [False, buf.getvalue(), "it printed no help and did not exit"]
  except SystemExit as e:
    out[entry] = [e.code in (0, None), buf.getvalue(), f"exit status {e.code}"]
  except BaseException as e:
    out[entry] = [False, buf.getvalue(), f"{type(e).__name__}: {e}"]
with open(where, "w", encoding="utf-8") as f:
  json.dump(out, f)
"""

_FLAGS: dict[str, frozenset[str] | None] = {}


def _argparse_flags(entry: str, source: str, ok: bool, text: str, error: str
                    ) -> frozenset[str]:
  if ok:
    return frozenset(re.findall(r"(?<![\w-])--([A-Za-z][\w-]*)", text))
  if "ModuleNotFoundError" in error:
    # The script's optional dependency is not installed here (the peer benchmark runs in
    # its own virtual environment): the flags its source declares to argparse stand in.
    return frozenset(_declared_argparse_flags(source))
  raise AssertionError(f"{entry} --help failed ({error}):\n{text[-2000:]}")


def prefetch_flags(entries) -> None:
  """Reads the help of every entry point in `entries` not read yet: absl programs one
  process each (`--helpfull`; they import nothing heavy first), argparse ones together."""
  absl, argparse_entries = [], []
  for entry in sorted(set(entries) - set(_FLAGS)):
    path = entry_point_file(entry)
    source = path.read_text(encoding="utf-8")
    if _is_absl(source):
      absl.append(entry)
    elif "argparse" in source:
      argparse_entries.append(entry)
    else:
      _FLAGS[entry] = None  # never run it: without a parser, `--help` runs the program
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  for entry in absl:
    result = subprocess.run([sys.executable, "-m", entry, "--helpfull"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=180)
    text = result.stdout + result.stderr
    # absl prints --helpfull and exits 1.
    if "--[no]helpfull" not in text:
      raise AssertionError(f"{entry} --helpfull failed:\n{text[-2000:]}")
    _FLAGS[entry] = frozenset(re.findall(r"^\s+--(?:\[no\])?([\w.-]+)", text, re.M))
  if not argparse_entries:
    return
  with tempfile.TemporaryDirectory() as tmp:
    out = pathlib.Path(tmp) / "help.json"
    result = subprocess.run([sys.executable, "-c", _HELP_RUNNER, json.dumps(argparse_entries),
                             str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=300)
    if not out.is_file():
      raise AssertionError(f"reading the entry points' help failed:\n{result.stderr[-2000:]}")
    texts = json.loads(out.read_text(encoding="utf-8"))
  for entry, (ok, text, error) in texts.items():
    source = entry_point_file(entry).read_text(encoding="utf-8")
    _FLAGS[entry] = _argparse_flags(entry, source, ok, text, error)


def flags_of(entry: str) -> frozenset[str] | None:
  """The long flags `entry` accepts, read from its help output (None: it takes no flags)."""
  if entry not in _FLAGS:
    prefetch_flags([entry])
  return _FLAGS[entry]


@functools.cache
def config_fields() -> frozenset[str]:
  sys.path.insert(0, str(ROOT))
  from configs import quickstart
  return frozenset(quickstart.get_config().keys())


MAIN = "pipe_rlhf_jax.main"
LAUNCH = "pipe_rlhf_jax.launch"


def command_problems(paths: list[pathlib.Path]) -> list[str]:
  """What is wrong with the commands quoted in `paths` (empty: nothing)."""
  commands = [(shown(path), *command) for path in paths for command in quoted_commands(path)]
  known = {entry for _, _, entry, _ in commands if entry_point_file(entry)}
  if LAUNCH in known:
    known.add(MAIN)
  prefetch_flags(known)  # each entry point's help once
  problems = []
  for rel, line, entry, args in commands:
    where = f"{rel}:{line}: `python {'-m ' if '/' not in entry else ''}{entry}`"
    if "/" in entry:
      module = entry.removesuffix(".py").replace("/", ".")
      problems.append(f"{where}: a script's path; run it as `python -m {module}` (the "
                      "scripts are modules of the experiments package)")
      continue
    if entry_point_file(entry) is None:
      problems.append(f"{where}: no such module or script")
      continue
    current = entry
    for arg in args:
      arg = arg.lstrip("[").rstrip("]")
      if arg == "--" and current == LAUNCH:
        current = MAIN  # the launcher passes what follows to every process of the job
        continue
      if not arg.startswith("--") or arg == "--":
        continue
      name, _, value = arg[2:].partition("=")
      if name == "config" and re.fullmatch(r"configs/\w+\.py(:\w+)?", value) and not (
          ROOT / value.split(":")[0]).is_file():
        problems.append(f"{where}: --config={value}: no such config file")
      if current == MAIN or "config" in (flags_of(current) or ()):
        if name.startswith("config."):
          field = name.split(".")[1]
          if field not in config_fields():
            problems.append(f"{where}: --{name}: configs/quickstart.py has no field "
                            f"{field!r}")
          continue
      accepted = flags_of(current)
      if accepted is None:
        problems.append(f"{where}: passes --{name}, but {current} takes no flags")
      elif name not in accepted and not (name.startswith("no") and name[2:] in accepted):
        problems.append(f"{where}: --{name} is not a flag of {current}")
  return problems


def test_quoted_commands_name_entry_points_and_flags_that_exist():
  problems = command_problems(markdown_files())
  assert not problems, "quoted commands that would not run:\n" + "\n".join(problems)


def test_the_command_check_names_each_kind_of_mistake(tmp_path):
  doc = tmp_path / "x.md"
  doc.write_text(
      "```bash\n"
      "python -m pipe_rlhf_jax.main --config=configs/quickstart.py --no_such_flag\n"
      "python -m pipe_rlhf_jax.main --config=configs/missing.py --config.no_such_part.x=1\n"
      "python -m pipe_rlhf_jax.no_such_module --x\n"
      "python -m experiments.bench_cpu_concurrency --repeats 3\n"
      "python experiments/bench_modes.py --page\n"
      "python -m pipe_rlhf_jax.launch --num_processes=2 -- --workdir=w --no_such_main_flag\n"
      "python -m pipe_rlhf_jax.main --config=configs/quickstart.py:tiny --noresume --workdir=w\n"
      "```\n")
  problems = "\n".join(command_problems([doc]))
  for expected in ("--no_such_flag is not a flag of pipe_rlhf_jax.main",
                   "--config=configs/missing.py: no such config file",
                   "configs/quickstart.py has no field 'no_such_part'",
                   "no such module or script",
                   "passes --repeats, but experiments.bench_cpu_concurrency takes no flags",
                   "run it as `python -m experiments.bench_modes`",
                   "--no_such_main_flag is not a flag of pipe_rlhf_jax.main"):
    assert expected in problems, (expected, problems)
  assert problems.count("\n") == 6, problems  # the last line is right


def test_the_link_check_names_missing_files_and_anchors(tmp_path):
  (tmp_path / "other.md").write_text("# A heading\n\n## `code` in it, too\n")
  doc = tmp_path / "x.md"
  doc.write_text("# Here\n[ok](other.md#a-heading) [ok](other.md#code-in-it-too) "
                 "[ok](#here) [ok](https://example.org/x#y) `[not a link](nowhere.md)`\n"
                 "[bad](missing.md) [bad](other.md#nowhere) [bad](#not-here)\n")
  problems = link_problems(doc)
  assert len(problems) == 3, problems
  assert "no such file" in problems[0] and "has no heading #nowhere" in problems[1]
  assert "has no heading #not-here" in problems[2]


def test_quoted_commands_are_found_with_their_arguments(tmp_path):
  doc = tmp_path / "x.md"
  doc.write_text("```bash\npython -m pipe_rlhf_jax.main --config=c.py \\\n  --resume  "
                 "# go on\n```\nthen `python -m experiments.learning_curves --seeds 0\n"
                 "--tag x` and `.venv/bin/python -m pipe_rlhf_jax.plan --top=3`.\n")
  found = [(entry, args) for _, entry, args in quoted_commands(doc)]
  assert found == [("pipe_rlhf_jax.main", ["--config=c.py", "--resume"]),
                   ("experiments.learning_curves", ["--seeds", "0", "--tag", "x"]),
                   ("pipe_rlhf_jax.plan", ["--top=3"])]


# ---- 4. Retired names -----------------------------------------------------------------


def retired_names() -> list[tuple[str, str, str]]:
  """(retired, now, kind) rows of the vocabulary's "Retired names" table."""
  text = (ROOT / "docs" / "vocabulary.md").read_text(encoding="utf-8")
  text = text.split("## Retired names", 1)[1]
  rows = []
  for line in text.splitlines():
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if len(cells) == 3 and cells[0].startswith("`"):
      rows.append((cells[0].split("`")[1], cells[1], cells[2]))
  return rows


def python_identifiers(path: pathlib.Path) -> set[str]:
  """Every name one Python file binds or reads: variables, arguments, keywords,
  attributes, functions, classes and the dotted modules it imports."""
  tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
  names = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Name):
      names.add(node.id)
    elif isinstance(node, ast.Attribute):
      names.add(node.attr)
    elif isinstance(node, ast.arg):
      names.add(node.arg)
    elif isinstance(node, ast.keyword) and node.arg:
      names.add(node.arg)
    elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
      names.add(node.name)
    elif isinstance(node, ast.Import):
      names.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module:
      names.add(node.module)
      names.update(f"{node.module}.{a.name}" for a in node.names)
  return names


# Another library's own names, which a retired name of ours happens to share: the peer
# benchmark builds tunix's `ppo_learner.PPOConfig`.
FOREIGN_NAMES = {("experiments/bench_peer_tunix.py", "PPOConfig")}


def test_retired_names_appear_nowhere():
  rows = retired_names()
  kinds = {kind for _, _, kind in rows}
  assert kinds == {"config key", "module", "identifier"} and len(rows) >= 8, rows
  found = []
  for path in python_files():
    names = python_identifiers(path)
    for old, _, kind in rows:
      foreign = (str(path.relative_to(ROOT)), old) in FOREIGN_NAMES
      if kind == "identifier" and old in names and not foreign:
        found.append(f"{path.relative_to(ROOT)}: identifier {old}")
      if kind == "module" and (old in names or any(n.startswith(old + ".") for n in names)):
        found.append(f"{path.relative_to(ROOT)}: imports {old}")
  for old, _, kind in rows:
    if kind == "module":
      file = ROOT / (old.replace(".", "/") + ".py")
      if file.exists() or file.with_suffix("").is_dir():
        found.append(f"{old} still exists")
  sys.path.insert(0, str(ROOT / "configs"))
  try:
    import quickstart  # every shipped config starts from it
    config = quickstart.get_config()
  finally:
    sys.path.remove(str(ROOT / "configs"))
  for old, _, kind in rows:
    if kind != "config key":
      continue
    node, parts = config, old.split(".")
    for part in parts[:-1]:
      node = node.get(part, {}) if hasattr(node, "get") else {}
    if parts[-1] in node:
      found.append(f"configs/quickstart.py: config key {old}")
    for doc in markdown_files():
      if re.search(rf"--config\.{re.escape(old)}[.=]", doc.read_text(encoding="utf-8")):
        found.append(f"{doc.relative_to(ROOT)}: --config.{old}")
  assert not found, "retired names still in use:\n" + "\n".join(found)

if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q"]))
