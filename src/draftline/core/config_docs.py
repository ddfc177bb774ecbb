"""``config/README.md``, generated from the config schema: one table per section.

The schema (``src/draftline/schemas/config.schema.yaml``) is the one place a key, its type, its
default and its meaning are written; this renders it for readers. ``draftline config-docs``
rewrites the file, ``draftline config-docs --check`` fails when it is not current (a test runs
the same comparison).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from draftline.core.config import load_schema

README = Path("config") / "README.md"

HEADER = """\
# Configuration

<!-- Generated from src/draftline/schemas/config.schema.yaml by `draftline config-docs`;
edit the schema, not this file. -->

`config/config.yaml` is the default config: a tiny toy target on a CPU. `config/kimi-k2.5.yaml`
is the production run (Kimi-K2.5 on 8 GPUs); give it on top of the default with
`snakemake --configfile config/kimi-k2.5.yaml` (the keys it sets replace the default's).
Every stage also runs alone: `draftline <stage> --config FILE --set key=value`.

A run's settings are layered, lowest first: the defaults below (settings for a real model),
a built-in target's own settings (the toy's demo settings, `src/draftline/data/toy/config.yaml`,
apply only when `target.model` is `toy`), `config/config.yaml`, the files given
(`snakemake --configfile`, `draftline --config`) and single keys (`--config`, `--set`).
`draftline plan`, every `draftline <stage>` and Snakemake resolve the same layers
(`draftline.core.config_layers`).

Every key has a default (below), so a config holds only what differs. An unknown key, a wrong
type or an out-of-range value stops the run before any job, with a message naming the key, and
so do the checks no schema can express (files that must exist, rules across keys:
`draftline.core.config_check`). A rule receives exactly the keys it reads: changing one reruns the
stages that read it and what depends on them.
"""


def leaves(node: dict, path: str = "") -> Iterator[tuple[str, dict]]:
    """(dotted key, schema) of every leaf key: a key that is not a section of keys. The keys of
    a list's items are named ``list[].key``; the list itself counts as a leaf too."""
    items = node.get("items")
    if isinstance(items, dict) and "properties" in items:
        yield path, node
        for name, sub in items["properties"].items():
            yield from leaves(sub, f"{path}[].{name}")
    elif "properties" in node:
        for name, sub in node["properties"].items():
            yield from leaves(sub, f"{path}.{name}" if path else name)
    else:
        yield path, node


def type_text(node: dict) -> str:
    """A key's type with its bounds: ``integer, >= 1``, ``"auto" | integer, 1 to 4096``."""
    if "enum" in node:
        return " | ".join(json.dumps(v) for v in node["enum"])
    if "const" in node:
        return json.dumps(node["const"])
    if "oneOf" in node:
        return " | ".join(type_text(option) for option in node["oneOf"])
    kinds = node.get("type", "any")
    text = " or ".join(kinds) if isinstance(kinds, list) else kinds
    if "items" in node and isinstance(node["items"], dict) and "properties" not in node["items"]:
        text += f" of {type_text(node['items'])}"
    if "minimum" in node and "maximum" in node:
        return f"{text}, {node['minimum']} to {node['maximum']}"
    bounds = [f"{op} {node[key]}" for key, op in (("minimum", ">="), ("exclusiveMinimum", ">"),
                                                   ("maximum", "<="), ("exclusiveMaximum", "<"))
              if key in node]
    return ", ".join([text, *bounds])


def _cell(text: str) -> str:
    """One Markdown table cell: one line, the pipe escaped, no text read as an HTML tag."""
    text = " ".join(str(text).split())
    return text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def render(schema: dict | None = None) -> str:
    """The whole of ``config/README.md``."""
    schema = schema or load_schema()
    out = [HEADER]
    for section, node in schema["properties"].items():
        out.append(f"## `{section}`\n")
        if node.get("description") and "properties" in node:
            out.append(_cell(node["description"]) + "\n")
        out.append("| key | type | default | description |\n|---|---|---|---|")
        for key, leaf in leaves(node, section):
            default = f"`{json.dumps(leaf['default'])}`" if "default" in leaf else "required"
            out.append(f"| `{key}` | {_cell(type_text(leaf))} | {_cell(default)} | "
                       f"{_cell(leaf.get('description', ''))} |")
        out.append("")
    return "\n".join(out)


def undocumented(schema: dict | None = None) -> list[str]:
    """Leaf keys without a description."""
    schema = schema or load_schema()
    return [key for key, leaf in leaves(schema) if not leaf.get("description")]


def write_or_check(path: Path = README, check: bool = False) -> int:
    """Write ``path`` (0), or with ``check`` compare it and return 1 when it is not current."""
    missing = undocumented()
    if missing:
        print(f"draftline config-docs: keys without a description in the schema: {missing}")
        return 1
    text = render()
    if check:
        if not path.is_file() or path.read_text() != text:
            print(f"draftline config-docs: {path} is not current; run `draftline config-docs`")
            return 1
        return 0
    path.write_text(text)
    return 0
