"""MkDocs hook: the HTTP API reference page, written from the service's own OpenAPI at build time.

The page is the document `GET /openapi.json` serves (`create_app().openapi()`), so it cannot drift
from the routes: one section per path and method (summary, description, parameters, request body,
responses), then every schema's fields. Nothing is fetched from the network.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files

PAGE = "reference/http-api.md"
METHODS = ("get", "put", "post", "delete", "patch", "head", "options")


def on_config(config: MkDocsConfig) -> MkDocsConfig:
    # The checkout being built (the server and its light client), not whichever copy the venv's
    # editable installs point at.
    root = Path(config.config_file_path).resolve().parent
    for path in (str(root / "client"), str(root)):
        if path not in sys.path:
            sys.path.insert(0, path)
    return config


def on_files(files: Files, config: MkDocsConfig) -> Files:
    files.append(File.generated(config, PAGE, content=render(service_openapi())))
    return files


def service_openapi() -> dict[str, Any]:
    """The service's OpenAPI document, built without starting it (no store, no log, no network)."""
    from app.api.main import create_app

    return create_app().openapi()


def render(spec: dict[str, Any]) -> str:
    """The reference page's markdown for an OpenAPI 3.1 document."""
    info = spec.get("info", {})
    out = [
        "# HTTP API",
        "",
        (
            f"Written at build time from the OpenAPI document of {info.get('title', 'the service')}"
            f" {info.get('version', '')} (`create_app().openapi()`, what `GET /openapi.json` "
            "serves and `GET /docs` shows interactively). The hand-written "
            "[endpoint table](../routers/endpoints.md) says what each route answers in prose. A "
            'route marked "Security: bearer token" takes `Authorization: Bearer <token>` once '
            "tokens are configured; [Security](../operators/security.md) says which scope each one "
            "needs, and which stay open unless `KVP_PROTECT_OBSERVABILITY=true`."
        ),
        "",
    ]
    by_tag: dict[str, list[tuple[str, str, dict[str, Any]]]] = {}
    for path, item in spec.get("paths", {}).items():
        for method in METHODS:
            if method in item:
                op = item[method]
                by_tag.setdefault((op.get("tags") or ["other"])[0], []).append((method, path, op))
    for tag, ops in by_tag.items():
        out += [f"## {tag.capitalize()}", ""]
        for method, path, op in ops:
            out += _operation(method, path, op)
    schemas = spec.get("components", {}).get("schemas", {})
    if schemas:
        out += ["## Schemas", ""]
        for name in sorted(schemas):
            out += _schema(name, schemas[name])
    return "\n".join(out) + "\n"


def _operation(method: str, path: str, op: dict[str, Any]) -> list[str]:
    slug = re.sub(r"[^a-z0-9]+", "-", f"{method} {path}".lower()).strip("-")
    out = [f"### `{method.upper()} {path}` {{#{slug}}}", ""]
    if op.get("summary"):
        out += [f"**{_text(op['summary'])}**", ""]
    if op.get("description"):
        out += [_text(op["description"]), ""]
    out += ["Security: bearer token." if op.get("security") else "Security: none.", ""]
    params = op.get("parameters") or []
    if params:
        out += [
            "| parameter | in | required | type | default | description |",
            "|---|---|---|---|---|---|",
        ]
        for p in params:
            schema = p.get("schema", {})
            default = f"`{schema['default']}`" if "default" in schema else ""
            out.append(
                f"| `{p['name']}` | {p['in']} | {'yes' if p.get('required') else 'no'} | "
                f"{_type(schema)} | {default} | {_cell(p.get('description', ''))} |"
            )
        out.append("")
    body = op.get("requestBody")
    if body:
        for content_type, media in body.get("content", {}).items():
            required = "required" if body.get("required") else "optional"
            schema = _type(media.get("schema", {}))
            out += [f"Request body ({required}): `{content_type}`, {schema}", ""]
    responses = op.get("responses") or {}
    if responses:
        out += ["| status | when | body |", "|---|---|---|"]
        for code in sorted(responses):
            answer = responses[code]
            kinds = [
                _type(media.get("schema", {}))
                + ("" if content_type == "application/json" else f" (`{content_type}`)")
                for content_type, media in answer.get("content", {}).items()
            ]
            out.append(f"| {code} | {_cell(answer.get('description', ''))} | {'; '.join(kinds)} |")
        out.append("")
    return out


def _schema(name: str, schema: dict[str, Any]) -> list[str]:
    out = [f"### {name} {{#{_schema_slug(name)}}}", ""]
    if schema.get("description"):
        out += [_text(schema["description"]), ""]
    props = schema.get("properties") or {}
    if not props:
        out += [f"{_type(schema)}", ""]
        return out
    required = set(schema.get("required") or [])
    out += ["| field | type | required | description |", "|---|---|---|---|"]
    for field, sub in props.items():
        desc = sub.get("description", "")
        if "const" in sub:
            desc = f"always `{sub['const']}`" + (f"; {desc}" if desc else "")
        out.append(
            f"| `{field}` | {_type(sub)} | {'yes' if field in required else 'no'} | {_cell(desc)} |"
        )
    out.append("")
    return out


def _schema_slug(name: str) -> str:
    return "schema-" + name.lower()


def _type(schema: dict[str, Any]) -> str:
    """A short, linked description of a JSON schema: `integer` (1 to 1000), array of (A or B)."""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return f"[{name}](#{_schema_slug(name)})"
    for key in ("oneOf", "anyOf"):
        if key in schema:
            return " or ".join(_type(s) for s in schema[key])
    kind = schema.get("type")
    if kind is None:
        return "any"
    if kind == "array":
        items = _type(schema.get("items", {}))
        text = "array of " + (f"({items})" if " or " in items else items)
        bounds = _bounds(schema.get("minItems"), schema.get("maxItems"), None, "items")
    elif kind == "string":
        text = "`string`"
        bounds = _bounds(schema.get("minLength"), schema.get("maxLength"), None, "characters")
    else:
        text = f"`{kind}`"
        bounds = _bounds(
            schema.get("minimum"), schema.get("maximum"), schema.get("exclusiveMaximum"), ""
        )
    if "enum" in schema:
        text += " (" + ", ".join(f"`{v}`" for v in schema["enum"]) + ")"
    return text + (f" ({bounds})" if bounds else "")


def _bounds(low: Any, high: Any, below: Any, unit: str) -> str:
    """`1 to 128 characters`, `at least 0`, `-5 to below 10`: the limits a value must keep."""
    suffix = f" {unit}" if unit else ""
    upper = f"{high}" if high is not None else (f"below {below}" if below is not None else None)
    if low is not None and upper is not None:
        return f"{low} to {upper}{suffix}"
    if low is not None:
        return f"at least {low}{suffix}"
    if high is not None:
        return f"at most {high}{suffix}"
    if below is not None:
        return f"below {below}{suffix}"
    return ""


def _text(text: str) -> str:
    """Docstring prose with `<`, `>` and `&` outside code spans escaped: not read as HTML."""
    parts = text.split("`")
    for i in range(0, len(parts), 2):
        parts[i] = parts[i].replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return "`".join(parts)


def _cell(text: str) -> str:
    """`_text` on one line, with `|` outside code spans escaped (inside them it does not split)."""
    parts = _text(" ".join(text.split())).split("`")
    for i in range(0, len(parts), 2):
        parts[i] = parts[i].replace("|", "\\|")
    return "`".join(parts)
