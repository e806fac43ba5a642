"""The package's layout: imports only point down its layers, no module imports in a circle or
reaches for another's private names, modules stay small, and jspec 0.1's module paths still import."""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

import pytest

from jspec import moved

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "jspec"
# Each folder (or module of jspec/ itself) and its layer: a module imports only from lower layers
# or from its own folder (docs/design.md, "Layout"). A new folder needs its place here.
LAYERS = {
    "errors": 0, "moved": 0, "files": 1, "prompt_sets": 1, "chat_template": 1, "distributed": 1,
    "tokenizer": 2, "jsonl": 2,
    "model": 10, "controllers": 10,
    "engine": 20, "batching": 20, "memory": 20, "prompts": 25, "records": 25,
    "convert": 30,
    "parts": 40,
    "drafters": 50,
    "methods": 60,
    "compilation_cache": 65, "api": 70,
    "": 80, "training": 80, "bench": 80,  # "": the face, jspec/__init__.py
    "cli": 90,
}
MOST_LINES = 420


def _name(path: Path) -> str:
    name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    return name.removesuffix(".__init__")


MODULES = {_name(p): p for p in PACKAGE.rglob("*.py")}


def _folder(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _imports(path: Path) -> list[tuple[int, str, str | None]]:
    """(line, imported jspec module, the name taken from it or None) of every import in the file,
    top level or inside a function."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, None) for a in node.names if a.name.startswith("jspec")]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("jspec"):
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                out.append((node.lineno, sub, None) if sub in MODULES else (node.lineno, node.module, a.name))
    return out


def test_every_folder_has_a_layer():
    assert {_folder(m) for m in MODULES} <= LAYERS.keys(), sorted({_folder(m) for m in MODULES} - LAYERS.keys())


def test_imports_point_down():
    up = [f"{_name(p)}:{line} imports {target} (layer {LAYERS[_folder(target)]} from {LAYERS[_folder(_name(p))]})"
          for p in MODULES.values() for line, target, _ in _imports(p)
          if _folder(target) != _folder(_name(p)) and LAYERS[_folder(target)] >= LAYERS[_folder(_name(p))]]
    assert not up, "\n".join(up)


def test_no_import_circle():
    edges = {m: {t for _, t, _ in _imports(p) if t in MODULES and t != m} for m, p in MODULES.items()}
    index, low, stack, on, circles = {}, {}, [], set(), []

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on.discard(component[-1])
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(MODULES):
        if v not in index:
            visit(v)
    assert not circles, circles


def test_no_private_name_is_used_elsewhere():
    """A leading underscore means the module's own: no other module (nor test) imports it or reads it."""
    used = []
    for path in [*MODULES.values(), *(ROOT / "tests").rglob("*.py")]:
        tree = ast.parse(path.read_text())
        bound = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("jspec"):
                for a in node.names:
                    if a.name.startswith("_") and not a.name.startswith("__"):
                        used.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {node.module}.{a.name}")
                    if f"{node.module}.{a.name}" in MODULES:
                        bound[a.asname or a.name] = f"{node.module}.{a.name}"
            elif isinstance(node, ast.Import):
                bound.update({a.asname: a.name for a in node.names if a.name.startswith("jspec") and a.asname})
        used += [f"{path.relative_to(ROOT)}:{node.lineno} reads {bound[node.value.id]}.{node.attr}"
                 for node in ast.walk(tree)
                 if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound
                 and node.attr.startswith("_") and not node.attr.startswith("__")]
    assert not used, "\n".join(used)


def test_modules_stay_small():
    long = {m: n for m, p in MODULES.items() if (n := len(p.read_text().splitlines())) > MOST_LINES}
    assert not long, long


def test_the_package_root_holds_the_face_the_api_and_a_few_helpers():
    assert {m for m in MODULES if "." not in m.removeprefix("jspec.") and m != "jspec"} == {
        f"jspec.{name}" for name in ("api", "batching", "chat_template", "compilation_cache", "distributed", "errors",
                                     "files", "jsonl", "memory", "moved", "prompt_sets", "prompts", "records",
                                     "tokenizer")} | {
        f"jspec.{folder}" for folder in ("bench", "cli", "controllers", "convert", "drafters", "engine", "methods",
                                         "model", "parts", "training")}


@pytest.mark.parametrize("old", sorted(moved.MOVED))
def test_an_old_module_path_imports_as_the_module_it_became(old):
    sys.modules.pop(old, None)  # as a process that never imported it
    with pytest.warns(DeprecationWarning, match=f"{old} is now {moved.MOVED[old]}"):
        module = importlib.import_module(old)
    assert module is importlib.import_module(moved.MOVED[old])
    assert module.__spec__.name == moved.MOVED[old]


def test_the_old_jspec_model_names_still_read():
    from jspec.model import decoder, layout

    with pytest.warns(DeprecationWarning, match="jspec.model.forward is now jspec.model.decoder.forward"):
        import jspec.model

        assert jspec.model.forward is decoder.forward
    with pytest.warns(DeprecationWarning, match="layout.param_shapes"):
        assert jspec.model.param_shapes is layout.param_shapes


def test_the_docs_walkthrough_adds_a_method(tiny_llama, monkeypatch, tmp_path, capsys):
    """docs/design.md's "Adding a method": its two files as written there, registered, make a
    method that decodes exactly ar's tokens, takes its option from the API and the command line,
    and refuses it with another method."""
    import importlib.util
    import re

    from support.spec import repetitive_prompts

    from jspec import methods
    from jspec.cli.main import build_parser
    from jspec.errors import JspecError

    text = (ROOT / "docs" / "design.md").read_text()
    section = text[text.index("## Adding a method"):]
    section = section[:section.index("\n## ", 1)]
    drafter_code, recipe_code = re.findall(r"```python\n(.*?)```", section, re.S)
    monkeypatch.setattr(methods, "REGISTRY", dict(methods.REGISTRY))
    for name, code in (("jspec.drafters.prompt_lookup", drafter_code), ("jspec.methods.prompt_lookup", recipe_code)):
        path = tmp_path / f"{name}.py"
        path.write_text(code)
        module = importlib.util.module_from_spec(importlib.util.spec_from_file_location(name, path))
        monkeypatch.setitem(sys.modules, name, module)
        module.__spec__.loader.exec_module(module)
    methods.register(sys.modules["jspec.methods.prompt_lookup"].METHOD)

    model = tiny_llama.jspec_model()
    prompts = repetitive_prompts((12, 30), model.cfg.vocab_size, seed=4)
    ar = model.generate(prompts, "ar", max_new_tokens=12)
    new = model.generate(prompts, "prompt-lookup", ngram=1, max_new_tokens=12)  # a random model repeats little
    assert [r["token_ids"] for r in new] == [r["token_ids"] for r in ar]
    assert sum(r["stats"]["drafted"] for r in new) > 0
    generate = next(a for a in build_parser()._actions if a.dest == "command").choices["generate"]
    assert any("--ngram" in a.option_strings for a in generate._actions)
    with pytest.raises(JspecError, match="--ngram must be between 1 and 8, got 9"):
        methods.build("prompt-lookup", model, ngram=9)
    with pytest.raises(JspecError, match="--ngram does not go with --method ar: it drafts nothing"):
        methods.build("ar", model, ngram=2)
