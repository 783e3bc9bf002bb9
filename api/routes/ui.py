"""GET /ui: the web page (jobs list, a job page with live curves), served from api/static.

The page itself needs no token (it holds no data); it asks for one and sends it with every
API request, as any client does. Only the files listed here are served.
"""

from pathlib import Path

from fastapi import APIRouter, HTTPException, status
from fastapi.responses import FileResponse

router = APIRouter(prefix="/ui", tags=["web page"], include_in_schema=False)
STATIC = Path(__file__).resolve().parents[1] / "static"
FILES = {  # name -> media type
    "index.html": "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
    "uPlot.iife.min.js": "text/javascript; charset=utf-8",  # uPlot 1.6.32 (MIT, npm), vendored unchanged
    "uPlot.min.css": "text/css; charset=utf-8",
}


def _file(name: str) -> FileResponse:
    if name not in FILES:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no such file: {name[:100]}")
    folder = STATIC / "vendor" if name.startswith("uPlot") else STATIC
    return FileResponse(folder / name, media_type=FILES[name], headers={"Cache-Control": "no-cache"})


@router.get("")
@router.get("/")
def page() -> FileResponse:
    return _file("index.html")


@router.get("/{name}")
def static_file(name: str) -> FileResponse:
    return _file(name)
