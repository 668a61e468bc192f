"""The project's shape, held: small functions, small strategy modules, no import cycle, no sys.path hacks, short
READMEs.

What docs/how-it-works.md draws stays readable only while these hold (docs/decisions.md, D100).
"""
import ast
import io
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "zerotune"
MAX_FUNCTION_LINES = 60  # lines of code: docstrings, comments and blank lines not counted
MAX_STRATEGY_MODULE_LINES = 300


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
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found.update(n for n in names if n in modules)
    return found - {module_name(path)}


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


def test_tests_and_benchmarks_import_as_packages_without_sys_path_edits():
    edits = [f"{p.relative_to(ROOT)}:{i}" for folder in ("tests", "benchmarks") for p in sorted((ROOT / folder).rglob("*.py"))
             if p.name != Path(__file__).name
             for i, line in enumerate(p.read_text().splitlines(), start=1) if "sys.path.insert" in line]
    assert edits == []


def test_the_readmes_stay_front_pages():
    """README.md says what zerotune does and links into docs/; benchmarks/README.md holds today's tables only
    (their history is docs/decisions.md)."""
    lines = {name: len((ROOT / name).read_text().splitlines()) for name in ("README.md", "benchmarks/README.md")}
    assert lines["README.md"] <= 150 and lines["benchmarks/README.md"] <= 300, lines
