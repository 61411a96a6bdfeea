"""Copy-heavy prompts made from the running Python's own standard library (its documentation and source, under the
Python Software Foundation licence, present on every machine): nothing to download or ship.

Kinds (`COPY_KINDS`), each over one module's document cut to about `tokens` tokens:
- summarize: "Summarize this documentation" + the module's pydoc text;
- rag: a question about one of the module's functions, answered from its pydoc text (retrieval-augmented style);
- extract: "List every function with its signature" + the pydoc text;
- edit: "Add a docstring to every function" + the module's source code.
"""

from __future__ import annotations

import importlib
import inspect
import pydoc

COPY_KINDS = ("summarize", "rag", "extract", "edit")
MODULES = ("textwrap", "shlex", "fnmatch", "bisect", "heapq", "glob", "calendar", "difflib", "fractions", "statistics",
           "string", "queue")
INSTRUCTIONS = {
    "summarize": "Summarize the following documentation of the Python module `{module}` in a few paragraphs.",
    "rag": "Using only the documentation below, explain what `{module}.{function}` does, quoting its signature and "
           "the sentences of the documentation that describe it.",
    "extract": "List every function of the Python module `{module}` described below, one per line, with its full "
               "signature and the first sentence of its description.",
    "edit": "Rewrite the following Python code with a one-line docstring added to every function. Return the whole "
            "code.",
}


def _document(module, kind: str) -> str:
    if kind == "edit":
        return inspect.getsource(module)
    return pydoc.render_doc(module, renderer=pydoc.plaintext)


def _first_function(module) -> str:
    names = [n for n, v in vars(module).items() if inspect.isfunction(v) and not n.startswith("_")
             and getattr(v, "__module__", None) == module.__name__]
    return sorted(names)[0] if names else "__init__"


def copy_prompts(tokenizer, kind: str, count: int, tokens: int = 700) -> list[str]:
    """`count` prompts of `kind` (one module each, in `MODULES` order), each about `tokens` tokens long."""
    if kind not in COPY_KINDS:
        raise ValueError(f"unknown copy-heavy prompt kind {kind!r}; choose from {', '.join(COPY_KINDS)}")
    if not 1 <= count <= len(MODULES):
        raise ValueError(f"count must be 1..{len(MODULES)}, got {count}")
    out = []
    for name in MODULES[:count]:
        module = importlib.import_module(name)
        instruction = INSTRUCTIONS[kind].format(module=name, function=_first_function(module))
        budget = max(tokens - len(tokenizer(instruction)["input_ids"]) - 8, 16)
        document = tokenizer.decode(tokenizer(_document(module, kind))["input_ids"][:budget])
        out.append(f"{instruction}\n\n{document}")
    return out
