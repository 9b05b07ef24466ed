"""/docs: Swagger UI served by the service itself, so the page works on a cluster with no way out.

FastAPI's own page loads Swagger UI from a public CDN, and is blank offline. The
script, style sheet and icon come instead from the `fastapi-swagger` package (a
dependency of the `api` extra that ships each Swagger UI release's static files;
nothing is copied into this repository), mounted under /docs/assets. ReDoc, which
no package here ships, is not served. Swagger UI's online validator badge is off.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse
from starlette.staticfiles import StaticFiles

DOCS_URL = "/docs"
ASSETS_URL = "/docs/assets"


def swagger_ui_directory() -> Path:
    """Where the installed fastapi-swagger keeps Swagger UI's files."""
    return Path(str(resources.files("fastapi_swagger") / "resources"))


def add_docs(app: FastAPI) -> None:
    app.mount(ASSETS_URL, StaticFiles(directory=swagger_ui_directory()), name="docs-assets")

    @app.get(DOCS_URL, include_in_schema=False)
    async def swagger_ui(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "").rstrip("/")  # behind a proxy that mounts the service under a prefix
        return get_swagger_ui_html(
            openapi_url=f"{root}{app.openapi_url}",
            title=f"{app.title} - API documentation",
            swagger_js_url=f"{root}{ASSETS_URL}/swagger-ui-bundle.js",
            swagger_css_url=f"{root}{ASSETS_URL}/swagger-ui.css",
            swagger_favicon_url=f"{root}{ASSETS_URL}/favicon-32x32.png",
            swagger_ui_parameters={"validatorUrl": None},
        )
