"""The project's shape, held: small functions, small strategy modules, no import cycle, layers imported only
downwards, no sys.path hacks, no test module imported by another, short READMEs.

What docs/how-it-works.md draws stays readable only while these hold (docs/decisions.md, D100).
"""
import ast
import io
import re
import subprocess
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "zerotune"
MAX_FUNCTION_LINES = 60  # lines of code: docstrings, comments and blank lines not counted
MAX_STRATEGY_MODULE_LINES = 300
MAX_MODULE_LINES = 400

LAYERS = (  # lowest first: a module imports its own layer and those before it, never a later one (docs/how-it-works.md)
    "core",  # the ground floor: errors, the records (experiment, step, launch), objective, units, measure
    "probe",  # the step probe (stdlib only in the ranks) and the tuner's reader of its streams
    "deepspeed",  # DeepSpeed's own facts: config, keys, validation, the launcher command
    "launchers",  # the user's launcher (deepspeed, torchrun, accelerate, python): read, its rank contract, its answer
    "model",  # the memory and throughput models, the profile
    "run",  # slots, the scheduler, backends, an experiment's directory, the resume key
    "inputs",  # the job: the user's script, ds_config and options read, checked and resolved
    "strategy",  # what to try next
    "report",  # what the user reads
    "autotuner",  # the Python API's facade
    "cli",  # the launcher-style command line
    "__main__",  # python -m zerotune
    "__init__",  # the package root: its names imported on first use, by name
)


def code_lines(source: str, tree: ast.Module) -> set[int]:
    """The line numbers holding code: no docstring, comment or blank line."""
    docs = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value,
                                                                                                    str):
                docs.update(range(first.lineno, first.end_lineno + 1))
    lines = set()
    skip = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER)
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in skip:
            lines.update(range(tok.start[0], tok.end[0] + 1))
    return lines - docs


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, tree: ast.Module, modules: set[str]) -> set[str]:
    """The zerotune modules ``path`` imports anywhere (TYPE_CHECKING and function-level imports included)."""
    return {n for _, names in zerotune_imports(path, tree) for n in names if n in modules} - {module_name(path)}


def layer(module: str) -> str:
    """The layer of a zerotune module: its top-level subpackage or module (``__init__`` for the package root)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def import_statements(path: Path, tree: ast.Module) -> list[tuple[int, list[str]]]:
    """Per import statement of ``path`` (TYPE_CHECKING blocks and functions included): its line and the names it
    loads, ``M`` and, for ``from M import x``, ``M.x`` too (a submodule where ``x`` is one); relative imports
    resolved from ``path``'s own package (one reaching above it is left out)."""
    package = module_name(path).split(".")[:-1] if path.name != "__init__.py" else module_name(path).split(".")
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level > len(package):
                continue
            base = ".".join(package[:len(package) - node.level + 1] if node.level else [])
            module = ".".join(p for p in (base, node.module) if p)
            names = [module] + [f"{module}.{alias.name}" for alias in node.names]
        else:
            continue
        found.append((node.lineno, names))
    return found


def zerotune_imports(path: Path, tree: ast.Module) -> list[tuple[int, list[str]]]:
    """:func:`import_statements` narrowed to the zerotune names each loads (statements loading none left out)."""
    found = [(line, [n for n in names if n.split(".")[0] == "zerotune"]) for line, names in import_statements(path, tree)]
    return [(line, names) for line, names in found if names]


def imported_test_modules(path: Path, tree: ast.Module) -> list[tuple[int, str]]:
    """(line, module) for each ``tests[.package].test_*`` module ``path`` imports anywhere, in any form: ``import
    tests.test_x``, ``from tests.test_x import y``, ``from tests import test_x``, and relative ones (``from .test_x
    import y``, ``from . import test_x``)."""
    found = []
    for line, names in import_statements(path, tree):
        for name in names:
            parts = name.split(".")
            at = next((i for i, part in enumerate(parts) if part.startswith("test_")), None)
            if parts[0] == "tests" and at is not None:
                found.append((line, ".".join(parts[:at + 1])))
    return sorted(set(found))


def test_no_function_in_the_package_is_over_60_lines_of_code():
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        source = path.read_text()
        tree = ast.parse(source)
        code = code_lines(source, tree)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = sum(1 for line in range(node.lineno, node.end_lineno + 1) if line in code)
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {n} lines")
    assert long == []


def test_no_strategy_module_is_over_300_lines():
    assert [(p.name, n) for p in sorted((PACKAGE / "strategy").rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_STRATEGY_MODULE_LINES] == []


def test_ruff_is_clean():
    """pyflakes' checks and import sorting over the whole tree (``[tool.ruff]`` in pyproject.toml)."""
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--quiet", str(ROOT)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-1000:]


def test_no_module_in_the_package_is_over_400_lines():
    assert [(str(p.relative_to(PACKAGE)), n) for p in sorted(PACKAGE.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES] == []


def test_the_probe_directory_holds_only_its_shim_and_a_standard_library_package():
    """``zerotune/probe`` is first on the ranks' ``sys.path``: what lies in it can shadow the user's modules, and
    what the probe imports runs in every rank, whose environment may not be the tuner's (never zerotune)."""
    probe = PACKAGE / "probe"
    assert sorted(p.name for p in probe.iterdir() if p.name != "__pycache__") == [
        "__init__.py", "_zerotune_probe", "sitecustomize.py"]
    imported = set()
    for path in [probe / "sitecustomize.py", *sorted((probe / "_zerotune_probe").rglob("*.py"))]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and not node.level:
                imported.add(node.module.split(".")[0])
    assert imported - set(sys.stdlib_module_names) == {"_zerotune_probe"}


def test_no_docstring_in_the_package_carries_sphinx_roles():
    """No documentation build reads them (issue 53): a name is written `as it is`, without ``:func:`` and its kin."""
    role = re.compile(r":(func|mod|data|class|meth|attr|exc|obj|const):`")
    found = [f"{p.relative_to(ROOT)}:{i}" for p in sorted(PACKAGE.rglob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1) if role.search(line)]
    assert found == []


def test_no_module_docstring_in_the_package_is_over_10_lines():
    """A module's docstring says what it owns and the rules a reader needs, with its decision ids; the evidence is
    docs/decisions.md's (issue 53)."""
    long = [(str(p.relative_to(PACKAGE)), len(doc.splitlines())) for p in sorted(PACKAGE.rglob("*.py"))
            if (doc := ast.get_docstring(ast.parse(p.read_text()), clean=False)) and len(doc.splitlines()) > 10]
    assert long == []


def test_the_package_has_no_import_cycle():
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {m: imports(p, ast.parse(p.read_text()), set(paths)) for m, p in paths.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycles.append(path[path.index(n):] + [n])
            elif n not in state:
                visit(n, path + [n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert cycles == []


def test_no_module_imports_a_higher_layer():
    """The layers stand on each other in :data:`LAYERS`'s order (issue 40): a type-only import counts too, since
    it ties the layers together for a reader as a runtime import does."""
    paths = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
    unplaced = sorted({layer(m) for m in paths} - set(LAYERS))
    assert unplaced == [], f"subpackages or modules with no place in LAYERS: {unplaced}"
    upward = []
    for module, path in paths.items():
        for line, names in zerotune_imports(path, ast.parse(path.read_text())):
            # the root package loads with every import; ``from zerotune import x`` imports zerotune.x
            imported = next((n for n in names if n != "zerotune"), None)
            low, high = layer(module), imported and layer(imported)
            if high and LAYERS.index(high) > LAYERS.index(low):
                upward.append(f"{module}:{line} imports {imported}: layer {low!r} imports the higher layer {high!r}")
    assert upward == [], "\n".join(upward)


def test_tests_and_benchmarks_import_as_packages_without_sys_path_edits():
    edits = [f"{p.relative_to(ROOT)}:{i}" for folder in ("tests", "benchmarks") for p in sorted((ROOT / folder).rglob("*.py"))
             if p.name != Path(__file__).name
             for i, line in enumerate(p.read_text().splitlines(), start=1) if "sys.path.insert" in line]
    assert edits == []


def test_no_test_module_is_imported_by_another_or_by_a_helper_or_a_benchmark():
    """A test module is a leaf: the harness tests share lives in tests/helpers, tests/conftest.py and
    benchmarks/ (issue 40). tests/regen_ledger_pins.py, a script, rewrites tests/unit/test_ledgers.py's pins."""
    paths = [p for folder in ("tests", "benchmarks") for p in sorted((ROOT / folder).rglob("*.py"))
             if p.name != "regen_ledger_pins.py"]
    found = [f"{p.relative_to(ROOT)}:{line} imports {module}" for p in paths
             for line, module in imported_test_modules(p, ast.parse(p.read_text())) if module != module_name(p)]
    assert found == []


def test_no_benchmark_imports_tests():
    """tests/ may import benchmarks/ (the simulator, the fault cases), never the other way round: a benchmark runs
    without the test suite (issue 53)."""
    found = [f"{p.relative_to(ROOT)}:{i}" for p in sorted((ROOT / "benchmarks").rglob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), start=1)
             if re.match(r"\s*(from|import) tests\b", line)]
    assert found == []


def test_the_readmes_stay_front_pages():
    """README.md says what zerotune does and links into docs/; benchmarks/README.md holds today's tables only
    (their history is docs/decisions.md)."""
    lines = {name: len((ROOT / name).read_text().splitlines()) for name in ("README.md", "benchmarks/README.md")}
    assert lines["README.md"] <= 150 and lines["benchmarks/README.md"] <= 300, lines


def test_how_it_works_names_every_module_of_the_tree():
    """docs/how-it-works.md's layout (its first code block) names every module of the package by its file's stem,
    so that the drawing follows the tree (issue 40)."""
    import re
    doc = (ROOT / "docs" / "how-it-works.md").read_text()
    layout = doc.split("```")[1]
    stems = sorted({p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")
                    if p.stem not in ("__init__", "__main__") and "__pycache__" not in p.parts})
    missing = [s for s in stems if not re.search(rf"\b{re.escape(Path(s).stem)}\b", layout)]
    assert not missing, f"docs/how-it-works.md's layout does not name: {missing}"


def test_tune_options_are_read_from_the_parser_by_name_not_copied_by_hand():
    import dataclasses

    from zerotune import cli
    from zerotune.inputs.options import LongestOptions, TuneOptions

    args, _ = cli.parse(["tune", "--num_gpus", "2", "--device-memory", "3GiB", "--var", "A=[1, 2]", "--timeout",
                         "60", "--max-seq-len", "512", "--verify-longest", "train.py"])
    dests = set(vars(args))
    # every field is an option's dest (by its name; --cpu's then resolved with the backend), or one
    # cli.tune_options resolves (the memory sizes, parsed) or builds by its rule (--var's, longest's)
    resolved = {"device_memory_bytes", "host_memory_bytes", "variables", "longest"}
    assert {f.name for f in dataclasses.fields(TuneOptions)} - dests == resolved
    assert {f.name for f in dataclasses.fields(LongestOptions)} <= dests
    options = cli.tune_options(args, cpu=True, device_memory_bytes=3 * 2**30, host_memory_bytes=None)
    assert (options.timeout_s, options.variables, options.longest) == (60.0, {"A": [1, 2]}, LongestOptions(512, True))
    assert Path(cli.__file__).read_text().count("TuneOptions(") == 1  # tune_options' one, by name
