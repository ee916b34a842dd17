"""The web console at ``/ui``: static HTML, CSS and JavaScript shipped in the package (``api/console/``, package
data), served by the API itself. No CDN and no build step: the browser loads the files as they are on disk.

The pages hold no data of their own: they call the API (``/v1/...``) with the key the user types in, kept in
the browser's sessionStorage only. The files are public; every call they make needs the key. A strict
Content-Security-Policy (own origin only, no inline script) keeps injected markup from running or calling out.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import RedirectResponse
from starlette.responses import Response
from starlette.staticfiles import StaticFiles
from starlette.types import Scope

CONSOLE_PATH = "/ui"
CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "object-src 'none'; base-uri 'none'; frame-ancestors 'none'; form-action 'none'")


class ConsoleFiles(StaticFiles):
    """The console's files with the console's security headers; ``no-cache`` so an upgrade shows at once."""

    async def get_response(self, path: str, scope: Scope) -> Response:
        response = await super().get_response(path, scope)
        response.headers["Content-Security-Policy"] = CSP
        response.headers["X-Content-Type-Options"] = "nosniff"
        response.headers["Referrer-Policy"] = "no-referrer"
        response.headers["Cache-Control"] = "no-cache"
        return response


def install_console(app: FastAPI) -> None:
    """Serve the console at ``/ui/`` (``/ui`` redirects there, so relative URLs in the page resolve)."""

    @app.get(CONSOLE_PATH, include_in_schema=False)
    async def console_root() -> RedirectResponse:
        return RedirectResponse(f"{CONSOLE_PATH}/")

    app.mount(CONSOLE_PATH, ConsoleFiles(packages=[("api", "console")], html=True), name="console")
