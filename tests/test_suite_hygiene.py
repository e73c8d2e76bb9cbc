"""The test suite's own hygiene: every test can fail, and every module states its tier.

A test whose assertions all sit inside ``for`` loops or comprehensions (``assert``,
``pytest.raises``, ``torch.testing.assert_close`` and other ``assert*`` calls, a helper of
the same module that asserts; ``assert all(... for x in xs)`` counts as inside its loop)
passes when the loop's iterable is empty: a job that returned nothing, a dict that lost
its keys. Such a test must also assert something outside its loops (the collection's
length, its keys, the whole structure at once with ``torch.testing.assert_close``), or
loop over something that cannot be empty: a literal list, tuple, set or dict, a ``range``
of constant non-zero length, a module-level constant or a name the test binds once to
one of these (or to a comprehension over them), a parameter that
``pytest.mark.parametrize`` gives only such values, and ``enumerate``, ``sorted``,
``.items()``, ``a + b`` or ``zip(..., strict=True)`` of any of them.

Tiers (docs/USAGE.md, "Tests"): each ``tests/test_*.py`` says at module level whether it
is ``quick``, ``slow`` or ``browser`` (``pytestmark``); a quick module marks its few slow
tests ``@pytest.mark.slow`` one by one, and conftest.py makes every test parametrized
with ``world_size > 2`` slow.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.quick

TESTS = Path(__file__).resolve().parent
MODULES = sorted(TESTS.glob("test_*.py"))
TIERS = {"quick", "slow", "browser"}

LOOPS = (ast.For, ast.AsyncFor)
COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)
NESTED_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)
# Calls that keep the length of the collection they wrap (or of the shortest, for zip).
WRAPPERS = {"enumerate", "sorted", "reversed", "list", "tuple", "set", "dict", "frozenset", "iter"}
VIEWS = {"items", "keys", "values"}


def _call_name(node: ast.AST) -> str:
    func = node.func if isinstance(node, ast.Call) else node
    if isinstance(func, ast.Attribute):
        return func.attr
    if isinstance(func, ast.Name):
        return func.id
    return ""


def _dotted(node: ast.AST) -> str:
    return ast.unparse(node)


def is_assertion(node: ast.AST, helpers: frozenset[str] = frozenset()) -> bool:
    """``assert``, ``pytest.raises``/``warns``/``fail``, any ``assert*`` call
    (``torch.testing.assert_close``, ``np.testing.assert_allclose``, ``_assert_same``), and
    a call of one of ``helpers``: functions of the same module that assert."""
    if isinstance(node, ast.Assert):
        return True
    if isinstance(node, ast.Call):
        name = _call_name(node)
        if name.lstrip("_").startswith("assert"):
            return True
        if isinstance(node.func, ast.Name) and name in helpers:
            return True
        return _dotted(node.func) in {"pytest.raises", "pytest.warns", "pytest.fail", "raises", "warns"}
    return False


def asserting_helpers(tree: ast.Module) -> frozenset[str]:
    """Module-level functions (not tests) that assert, directly or through one another."""
    functions = {s.name: s for s in tree.body
                 if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef)) and not s.name.startswith("test")}
    helpers: frozenset[str] = frozenset()
    while True:
        more = frozenset(name for name, fn in functions.items()
                         if any(is_assertion(n, helpers) for n in ast.walk(fn)))
        if more == helpers:
            return helpers
        helpers = more


def _positive_int(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and type(node.value) is int and node.value > 0


class _Constants:
    """What is known not to be empty in one module: module-level names bound to a non-empty
    literal collection and, within one test, its parametrized arguments and the names it binds
    once to such a collection."""

    def __init__(self, tree: ast.Module):
        self.names: dict[str, ast.AST] = {}
        for stmt in tree.body:
            if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
                self.names[stmt.targets[0].id] = stmt.value
            elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.value is not None:
                self.names[stmt.target.id] = stmt.value
        self.params: dict[str, list[ast.AST]] = {}

    def for_function(self, fn: ast.FunctionDef | ast.AsyncFunctionDef) -> _Constants:
        """A copy that also knows ``fn``'s parametrized arguments and the names it binds once."""
        scoped = object.__new__(_Constants)
        scoped.names = dict(self.names)
        scoped.params = {}
        for deco in fn.decorator_list:
            if not (isinstance(deco, ast.Call) and _call_name(deco) == "parametrize" and len(deco.args) >= 2):
                continue
            argnames, values = deco.args[0], deco.args[1]
            if not isinstance(argnames, ast.Constant) or not isinstance(argnames.value, str):
                continue
            names = [a.strip() for a in argnames.value.split(",") if a.strip()]
            values = self.names.get(values.id, values) if isinstance(values, ast.Name) else values
            if not isinstance(values, (ast.List, ast.Tuple)):
                continue
            for i, name in enumerate(names):
                if len(names) == 1:
                    scoped.params[name] = list(values.elts)
                elif all(isinstance(v, (ast.Tuple, ast.List)) and len(v.elts) == len(names) for v in values.elts):
                    scoped.params[name] = [v.elts[i] for v in values.elts]
        # Names the test binds once, at its top level, to what cannot be empty (runs = [... for s in STAGES]).
        assigned: dict[str, list[ast.AST]] = {}
        for node in ast.walk(fn):
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            for target in targets:
                for name in ast.walk(target) if isinstance(target, ast.AST) else ():
                    if isinstance(name, ast.Name) and isinstance(name.ctx, ast.Store):
                        assigned.setdefault(name.id, []).append(node)
        for stmt in fn.body:
            if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
                name = stmt.targets[0].id
                if assigned.get(name) == [stmt] and name not in scoped.params and scoped.nonempty(stmt.value):
                    scoped.names[name] = stmt.value
        return scoped

    def positive(self, node: ast.AST, depth: int = 0) -> bool:
        """``node`` is an int known to be > 0."""
        if depth > 8:
            return False
        if _positive_int(node):
            return True
        if isinstance(node, ast.Name):
            if node.id in self.params:
                return bool(self.params[node.id]) and all(self.positive(v, depth + 1) for v in self.params[node.id])
            if node.id in self.names:
                return self.positive(self.names[node.id], depth + 1)
        if isinstance(node, ast.Call) and _call_name(node) == "len" and len(node.args) == 1:
            return self.nonempty(node.args[0], depth + 1)
        return False

    def nonempty(self, node: ast.AST, depth: int = 0) -> bool:
        """``node`` is a collection that cannot be empty whatever the code under test does."""
        if depth > 8:
            return False
        if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
            return bool(node.elts) and any(not isinstance(e, ast.Starred) or self.nonempty(e.value, depth + 1)
                                           for e in node.elts)
        if isinstance(node, ast.Dict):
            return bool(node.keys)
        if isinstance(node, ast.Constant):
            return isinstance(node.value, (str, bytes, tuple)) and len(node.value) > 0
        if isinstance(node, ast.Name):
            if node.id in self.params:
                values = self.params[node.id]
                return bool(values) and all(self.nonempty(v, depth + 1) for v in values)
            if node.id in self.names:
                return self.nonempty(self.names[node.id], depth + 1)
            return False
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):  # a + b: one of them suffices
            return self.nonempty(node.left, depth + 1) or self.nonempty(node.right, depth + 1)
        if isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
            return all(not gen.ifs and self.nonempty(gen.iter, depth + 1) for gen in node.generators)
        if isinstance(node, ast.Call):
            name = _call_name(node)
            if isinstance(node.func, ast.Name) and name == "range":
                args = node.args
                if len(args) == 1:
                    return self.positive(args[0], depth + 1)
                if len(args) == 2 and all(isinstance(a, ast.Constant) and type(a.value) is int for a in args):
                    return args[1].value > args[0].value
                return False
            if isinstance(node.func, ast.Name) and name in WRAPPERS and len(node.args) == 1:
                return self.nonempty(node.args[0], depth + 1)
            if isinstance(node.func, ast.Name) and name == "zip" and node.args:
                strict = any(k.arg == "strict" and isinstance(k.value, ast.Constant) and k.value.value is True
                             for k in node.keywords)
                known = [self.nonempty(a, depth + 1) for a in node.args]
                return all(known) or (strict and any(known))
            if name == "product" and node.args:  # itertools.product
                return all(self.nonempty(a, depth + 1) for a in node.args)
            if isinstance(node.func, ast.Attribute) and name in VIEWS and not node.args:
                return self.nonempty(node.func.value, depth + 1)
        return False


def _scan(node: ast.AST, loops: tuple[ast.AST, ...], found: list, helpers: frozenset[str] = frozenset()):
    """Every assertion under ``node``, each with the iterables of the loops it sits in
    (``assert all(... for x in xs)`` sits in the loop over ``xs``: it holds when ``xs`` is
    empty). Nested functions, lambdas and classes are not entered: their bodies need not run."""
    if isinstance(node, NESTED_SCOPES):
        return
    if is_assertion(node, helpers):
        test = node.test if isinstance(node, ast.Assert) else None
        if (isinstance(test, ast.Call) and isinstance(test.func, ast.Name) and test.func.id == "all"
                and len(test.args) == 1 and isinstance(test.args[0], COMPREHENSIONS)):
            found.append((node, loops + tuple(gen.iter for gen in test.args[0].generators)))
        else:
            found.append((node, loops))
    if isinstance(node, LOOPS):
        _scan(node.target, loops, found, helpers)
        _scan(node.iter, loops, found, helpers)
        for stmt in node.body:
            _scan(stmt, loops + (node.iter,), found, helpers)
        for stmt in node.orelse:
            _scan(stmt, loops, found, helpers)
        return
    if isinstance(node, COMPREHENSIONS):
        inner = loops
        for gen in node.generators:
            _scan(gen.iter, inner, found, helpers)
            inner = inner + (gen.iter,)
            for cond in gen.ifs:
                _scan(cond, inner, found, helpers)
        for elt in ([node.key, node.value] if isinstance(node, ast.DictComp) else [node.elt]):
            _scan(elt, inner, found, helpers)
        return
    for child in ast.iter_child_nodes(node):
        _scan(child, loops, found, helpers)


def _tests_in(tree: ast.Module):
    """Module-level ``test_*`` functions and ``test_*`` methods of its classes."""
    for stmt in tree.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name.startswith("test"):
            yield stmt.name, stmt
        elif isinstance(stmt, ast.ClassDef):
            for sub in stmt.body:
                if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)) and sub.name.startswith("test"):
                    yield f"{stmt.name}::{sub.name}", sub


def vacuous_tests(path: Path) -> list[str]:
    """``file::function`` for each test whose every assertion sits in a loop that may run
    zero times: an empty iterable makes the test pass without checking anything."""
    tree = ast.parse(path.read_text(), filename=str(path))
    module = _Constants(tree)
    helpers = asserting_helpers(tree)
    offenders = []
    for name, fn in _tests_in(tree):
        constants = module.for_function(fn)
        found: list = []
        for stmt in fn.body:
            _scan(stmt, (), found, helpers)
        if found and all(any(not constants.nonempty(it) for it in loops) for _, loops in found):
            offenders.append(f"{path.name}::{name}")
    return offenders


def module_tiers(path: Path) -> set[str]:
    """The marks a module-level ``pytestmark`` names: ``pytest.mark.X`` or a list of them."""
    tree = ast.parse(path.read_text(), filename=str(path))
    marks: set[str] = set()
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark"
                                                for t in stmt.targets):
            values = stmt.value.elts if isinstance(stmt.value, (ast.List, ast.Tuple)) else [stmt.value]
            for value in values:
                node = value.func if isinstance(value, ast.Call) else value
                if isinstance(node, ast.Attribute) and _dotted(node.value) == "pytest.mark":
                    marks.add(node.attr)
    return marks


def test_the_suite_has_modules_to_check():
    assert len(MODULES) > 50, MODULES


def test_no_test_passes_by_looping_over_nothing():
    offenders = [o for path in MODULES for o in vacuous_tests(path)]
    assert not offenders, (
        f"{len(offenders)} tests assert only inside loops that may run zero times; assert the collection's "
        "length (or compare the whole structure) outside the loop:\n" + "\n".join(offenders))


def test_every_module_states_its_tier():
    untiered = [p.name for p in MODULES if not module_tiers(p) & TIERS]
    assert not untiered, f"no module-level pytestmark with one of {sorted(TIERS)}: {untiered}"
    several = [p.name for p in MODULES if len(module_tiers(p) & TIERS) > 1]
    assert not several, f"more than one tier: {several}"


SAMPLES = {  # id: (a test module's source, whether its test can pass by looping over nothing)
    "loop over an argument": ("def test_a(xs):\n    for x in xs:\n        assert x\n", True),
    "length asserted first": ("def test_a(xs):\n    assert xs\n    for x in xs:\n        assert x\n", False),
    "literal tuple": ("def test_a():\n    for x in (1, 2):\n        assert f(x)\n", False),
    "range(3)": ("def test_a():\n    for x in range(3):\n        assert f(x)\n", False),
    "range(0)": ("def test_a():\n    for x in range(0):\n        assert f(x)\n", True),
    "module constant": ("S = (1, 2)\ndef test_a():\n    for x in S:\n        assert f(x)\n", False),
    "constant outside, dict inside": ("S = (1, 2)\ndef test_a(d):\n    for x in S:\n        for k, v in d.items():\n"
                                      "            assert v\n", True),
    "local list built from a constant": ("S = (1, 2)\ndef test_a():\n    runs = [f(s) for s in S]\n"
                                         "    for r, s in zip(g(runs), runs, strict=True):\n        assert r == s\n",
                                         False),
    "zip without strict": ("S = (1, 2)\ndef test_a():\n    for r, s in zip(g(), S):\n        assert r == s\n", True),
    "sum of lists": ("def test_a(xs):\n    for x in xs + [1]:\n        assert f(x)\n", False),
    "comprehension": ("def test_a(d):\n    [torch.testing.assert_close(a, b) for a, b in d]\n", True),
    "assert all(...)": ("def test_a(xs):\n    assert all(x > 0 for x in xs)\n", True),
    "pytest.raises in a loop": ("def test_a(d):\n    for a in d:\n        with pytest.raises(ValueError):\n"
                                "            f(a)\n", True),
    "helper that asserts": ("def check(x):\n    assert x\ndef test_a(xs):\n    for x in xs:\n        check(x)\n",
                            True),
    "parametrized count": ("import pytest\n@pytest.mark.parametrize('n', [1, 2])\ndef test_a(n):\n"
                           "    for r in range(n):\n        assert f(r)\n", False),
    "no assertion": ("def test_a(xs):\n    for x in xs:\n        f(x)\n", False),  # not this check's concern
    "method": ("class TestA:\n    def test_b(self, xs):\n        for x in xs:\n            assert x\n", True),
}


@pytest.mark.parametrize("name", list(SAMPLES))
def test_the_vacuous_loop_check_tells_them_apart(tmp_path, name):
    source, vacuous = SAMPLES[name]
    path = tmp_path / "test_sample.py"
    path.write_text(source)
    assert bool(vacuous_tests(path)) is vacuous, source


def test_the_tier_check_reads_a_mark_or_a_list_of_them(tmp_path):
    path = tmp_path / "test_sample.py"
    path.write_text("import pytest\npytestmark = [pytest.mark.quick, pytest.mark.notebook]\n")
    assert module_tiers(path) == {"quick", "notebook"}
    path.write_text("import pytest\npytestmark = pytest.mark.slow  # why\n")
    assert module_tiers(path) == {"slow"}
    path.write_text("import pytest\n\n@pytest.mark.slow\ndef test_a():\n    pass\n")
    assert module_tiers(path) == set()
