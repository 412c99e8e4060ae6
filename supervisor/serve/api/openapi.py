"""The OpenAPI document says what the routes answer (issue 21: schemathesis `--checks all`
found ~80 mismatches), and the answers keep to it.

What every route shares is written here once, not on each route:

- **Errors.** Every error is `{"detail": "<one sentence>"}`: FastAPI's own 422 (a list of
  pydantic errors) is answered in that shape too (`validation_error`), and every operation
  documents the statuses the daemon's layers may give it: 400 unreadable body, 401/403 token,
  404 unknown run/action, 409 conflict, 413 too large (supervisor.serve.body), 422 invalid,
  429 quota or read budget (supervisor.serve.api.reads), 503 database unavailable, too many bodies in
  flight or reads waiting too long (Retry-After).
- **Path parameters** hold what ParamLimits (supervisor.serve.api) enforces before routing: a run id
  of 1-200 characters without '/', control characters, `.` or `..`; attempt and action ids
  within their Integer columns.
- **405** answers carry `Allow` with every method the path has (routers that share a path, such
  as GET and POST /api/runs, each knew only their own).
"""

from __future__ import annotations

import re
from typing import Any, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from thermowatch.monitors.contract import INT32_MAX, INT64_MAX
from thermowatch.supervisor.serve.api.schemas import RUN_ID_PATTERN
from thermowatch.supervisor.limits import RUN_ID_CHARS

ERROR_SCHEMA = {"type": "object", "required": ["detail"], "additionalProperties": True,
                "properties": {"detail": {"type": "string", "description": "what was wrong and how to fix it"}}}
ERRORS = {
    "400": "the body is not readable (not JSON, a bad Content-Length)",
    "401": "no token, or an unknown or revoked one",
    "403": "the token lacks the scope this needs",
    "404": "no such run, attempt, action or token",
    "409": "conflicts with what is stored (stored history is immutable; an action in another state)",
    "413": "the body or batch is larger than this route takes",
    "422": "a value is invalid; the detail names it",
    "429": "a quota or this client's read budget is used up; Retry-After says when to try again",
    "503": "the database is unavailable or the daemon is busy (bodies or reads waiting); retry after Retry-After",
}
PATH_PARAMS = {
    "run_id": {"type": "string", "minLength": 1, "maxLength": RUN_ID_CHARS, "pattern": RUN_ID_PATTERN},
    "attempt": {"type": "integer", "minimum": 0, "maximum": INT32_MAX},
    "action_id": {"type": "integer", "minimum": 0, "maximum": INT32_MAX},
}
OPEN_PATHS = {"/healthz", "/readyz", "/readyz/leader"}  # no token, no body, no parameters: 503 only
# Text a column can hold (supervisor.limits.check_text): no NUL. (No lone surrogate either, but a
# pattern naming them is one schemathesis' generator cannot use, and drops.)
TEXT_PATTERN = r"^[^\x00]*$"
# Free-form JSON in a body (a run's config, a manifest, a command's args) holds text like that,
# keys included, and nests at most limits.max_json_depth levels (not expressible here).
JSON_COMPONENTS = {
    "JsonValue": {"anyOf": [{"type": "string", "pattern": TEXT_PATTERN}, {"type": "number"}, {"type": "boolean"},
                            {"type": "null"}, {"type": "array", "items": {"$ref": "#/components/schemas/JsonValue"}},
                            {"$ref": "#/components/schemas/JsonObject"}]},
    "JsonObject": {"type": "object", "propertyNames": {"pattern": TEXT_PATTERN},
                   "additionalProperties": {"$ref": "#/components/schemas/JsonValue"}},
}


def _clean_text(node: Any) -> Any:
    """Request-body schemas: free strings get TEXT_PATTERN, free-form objects become JsonObject."""
    if isinstance(node, list):
        return [_clean_text(x) for x in node]
    if not isinstance(node, dict):
        return node
    node = {k: _clean_text(v) for k, v in node.items()}
    if node.get("type") == "string" and "pattern" not in node and "enum" not in node and "format" not in node:
        node["pattern"] = TEXT_PATTERN
    if node.get("type") == "object" and node.get("additionalProperties", True) is True and "properties" not in node:
        return {k: v for k, v in node.items() if k not in ("type", "additionalProperties")} | \
            {"$ref": "#/components/schemas/JsonObject"}
    return node


def _bound_ints(node: dict[str, Any]) -> None:
    """An integer query parameter holds what ParamLimits (supervisor.serve.api) lets through: a 64-bit
    integer, unless its route declares tighter bounds."""
    for sub in [node, *node.get("anyOf", ())]:
        if sub.get("type") == "integer":
            sub.setdefault("minimum", -INT64_MAX - 1)
            sub.setdefault("maximum", INT64_MAX)


def document(schema: dict[str, Any]) -> dict[str, Any]:
    """The app's generated document, with what every route shares (the module docstring)."""
    schema.get("components", {}).get("schemas", {}).pop("HTTPValidationError", None)
    schema.get("components", {}).get("schemas", {}).pop("ValidationError", None)
    schema.setdefault("components", {}).setdefault("schemas", {}).update(JSON_COMPONENTS)
    for path, ops in schema.get("paths", {}).items():
        for op in ops.values():
            for media in op.get("requestBody", {}).get("content", {}).values():
                if "schema" in media and media["schema"].get("format") != "binary":
                    media["schema"] = _clean_text(media["schema"])
            for p in op.get("parameters", ()):
                if p.get("in") == "path" and p.get("name") in PATH_PARAMS:
                    p["schema"] = dict(PATH_PARAMS[p["name"]])
                elif p.get("in") == "query" and p.get("schema", {}).get("type") == "string":
                    p["schema"].setdefault("pattern", r"^[^\x00]*$")  # NUL: no column holds it
                elif p.get("in") == "query":
                    _bound_ints(p.get("schema", {}))
            responses = op.setdefault("responses", {})
            for code, why in ERRORS.items():
                if path in OPEN_PATHS and code != "503":
                    continue
                if code not in responses or code == "422":
                    responses[code] = {"description": responses.get(code, {}).get("description") or why,
                                       "content": {"application/json": {"schema": ERROR_SCHEMA}}}
    return schema


def explain(errors: Sequence[Any], what: str) -> str:
    """Pydantic's errors as the one sentence a 422 carries: where, what was wrong, and the value
    sent when it is short enough to quote (so `scopes.0: 'root' ...` names the bad scope)."""
    first = errors[0] if errors else {}
    where = ".".join(str(p) for p in first.get("loc", ())) or what
    got = first.get("input")
    sent = f" (got {got!r})" if isinstance(got, (str, int, float, bool)) and len(repr(got)) <= 60 else ""
    return f"{where}: {first.get('msg', 'invalid')}{sent} ({len(errors)} problem(s) in the {what})"


def install(app: FastAPI) -> None:
    """The document above, FastAPI's 422 as one sentence, and 405's Allow header."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = document(generate())
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse({"detail": explain(exc.errors(), "request")}, 422)

    app.add_middleware(AllowHeader, methods_of=lambda: _methods(openapi()))


def _methods(schema: dict[str, Any]) -> list[tuple[re.Pattern, str]]:
    out = []
    for path, ops in schema.get("paths", {}).items():
        pattern = re.compile("^" + re.sub(r"\\\{[^/]+?\\\}", "[^/]+", re.escape(path)) + "$")
        methods = sorted(m.upper() for m in ops)
        if "GET" in methods:
            methods.append("HEAD")
        out.append((pattern, ", ".join(methods)))
    return out


class AllowHeader:
    """ASGI middleware: a 405 names every method its path has (RFC 9110 15.5.6)."""

    def __init__(self, app, methods_of) -> None:
        self.app = app
        self.methods_of = methods_of
        self._table: list[tuple[re.Pattern, str]] | None = None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def allow(message) -> None:
            if message["type"] == "http.response.start" and message["status"] == 405:
                if self._table is None:
                    self._table = self.methods_of()
                methods = next((m for p, m in self._table if p.match(scope["path"])), None)
                if methods:
                    headers = [(k, v) for k, v in message.get("headers", ()) if k.lower() != b"allow"]
                    message = {**message, "headers": headers + [(b"allow", methods.encode())]}
            await send(message)

        await self.app(scope, receive, allow)
