"""The house stays walkable: size limits per module, class, function and folder (issue 30's targets).

A module over 400 lines, a class over 300 or a function over 80 is a room doing more than one job;
a folder over 12 modules is a wing that wants splitting. Measured with ``ast`` on the source tree.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("consumer", "producer", "protocol", "cli")
MAX_MODULE_LINES = 400
MAX_CLASS_LINES = 300
MAX_FUNCTION_LINES = 80
MAX_MODULES_PER_FOLDER = 12


def _modules(include_benchmarks: bool = False) -> list[Path]:
    roots = PACKAGES + (("benchmarks",) if include_benchmarks else ())
    return sorted(p for r in roots for p in (ROOT / r).rglob("*.py") if "__pycache__" not in p.parts)


def _oversized(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            limit = MAX_CLASS_LINES if isinstance(node, ast.ClassDef) else MAX_FUNCTION_LINES
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            lines = node.end_lineno - start + 1
            if lines > limit:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} is {lines} lines (limit {limit})")
    return found


def test_no_module_over_the_line_limit():
    long = [f"{p.relative_to(ROOT)}: {n} lines" for p in _modules()
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES]
    assert not long, "split these modules by job:\n" + "\n".join(long)


def test_no_class_or_function_over_the_line_limit():
    found = [line for p in _modules(include_benchmarks=True) for line in _oversized(p)]
    assert not found, "split these:\n" + "\n".join(found)


@pytest.mark.parametrize("root", PACKAGES)
def test_no_folder_over_the_module_limit(root):
    crowded = []
    for folder in [ROOT / root, *[d for d in (ROOT / root).rglob("*") if d.is_dir() and d.name != "__pycache__"]]:
        count = len([p for p in folder.glob("*.py") if p.name != "__init__.py"])
        if count > MAX_MODULES_PER_FOLDER:
            crowded.append(f"{folder.relative_to(ROOT)}: {count} modules")
    assert not crowded, "group these into wings:\n" + "\n".join(crowded)


#: the facades users import, side by side by framework, each in its framework's wing
FACADE_MODULES = {"consumer/tf/zmq_input.py": "stoker.consumer.tf.zmq_input",
                  "consumer/numpy/batch_stream.py": "stoker.consumer.numpy.batch_stream",
                  "consumer/torch/torch_input.py": "stoker.consumer.torch.torch_input"}
#: what every facade stands on (and nothing below it may import)
FACADE_BASE = ("stoker.consumer.input_base", "stoker.consumer.input_setup")
FACADES = (*FACADE_MODULES.values(), *FACADE_BASE)
#: what each part of the tree must not import (docs/decisions.md, "Map of the house"); type-only imports
#: (under ``if TYPE_CHECKING:``) are not arrows at run time and are left out
FORBIDDEN = {
    "protocol/": ("stoker.consumer", "stoker.producer", "stoker.cli"),
    "producer/": ("stoker.consumer", "stoker.cli"),
    "consumer/": ("stoker.producer", "stoker.cli"),
    "consumer/transport/": ("stoker.consumer.torch", "stoker.consumer.exact", "stoker.consumer.tf",
                            "stoker.consumer.train", *FACADES),
    "consumer/exact/": ("stoker.consumer.torch", "stoker.consumer.tf", "stoker.consumer.train", *FACADES),
    "consumer/tf/": ("stoker.consumer.torch", "stoker.consumer.exact", "stoker.consumer.transport",
                     "stoker.consumer.train", *FACADES),
    # PyTorch's wing: on the facades' shared base and the floor's queue, never TensorFlow (TorchInput must not load it)
    "consumer/torch/": ("stoker.consumer.tf", "stoker.consumer.numpy", "stoker.consumer.train", "tensorflow"),
    # the NumPy stream: neither TensorFlow nor PyTorch
    "consumer/numpy/": ("stoker.consumer.tf", "stoker.consumer.torch", "stoker.consumer.train", "tensorflow", "torch"),
    # where producers run (a local producer): a command line and a child process, nothing of the consumer's wings
    "consumer/placement/": ("stoker.consumer.transport", "stoker.consumer.exact", "stoker.consumer.tf",
                            "stoker.consumer.torch", "stoker.consumer.train", "stoker.consumer.receive", *FACADES),
    # the framework-free floor every facade stands on: nothing of the consumer's wings above it
    "consumer/receive/": ("stoker.consumer.transport", "stoker.consumer.exact", "stoker.consumer.tf",
                          "stoker.consumer.torch", "stoker.consumer.train", *FACADES),
}


def _runtime_imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
            and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
    names = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
        elif isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
    return names


def test_imports_go_down_the_map_of_the_house():
    upward = []
    for path in _modules():
        rel = str(path.relative_to(ROOT))
        for part, forbidden in FORBIDDEN.items():
            if rel.startswith(part) or rel == part:
                if rel in FACADE_MODULES:  # a facade stands on the shared base, over its framework's wing
                    forbidden = tuple(f for f in forbidden if f not in FACADE_BASE and f != FACADE_MODULES[rel])
                upward += [f"{rel} imports {name}" for name in _runtime_imports(path)
                           if any(name == f or name.startswith(f + ".") for f in forbidden)]
    assert not upward, "imports against the map of the house (docs/decisions.md):\n" + "\n".join(upward)
