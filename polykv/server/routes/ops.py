"""Operations: /health (open even with an API key), /v1/status, the status page. (/metrics is
installed by metrics.py.)"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Depends
from fastapi.responses import HTMLResponse, JSONResponse

from ..state import ServerState, get_state

__all__ = ["router"]

router = APIRouter(tags=["ops"])

_STATIC = Path(__file__).resolve().parents[1] / "static"


@router.get("/health")
async def health(state: ServerState = Depends(get_state)):
    eng = state.engine
    ok = eng.running
    body = {"status": "ok" if ok else "stopping", "model": state.model_name,
            "live_agents": eng.live_agents(), "documents": len(state.docs)}
    return JSONResponse(body, status_code=200 if ok else 503)


@router.get("/v1/status")
async def status(state: ServerState = Depends(get_state)):
    return await state.status()


@router.get("/", response_class=HTMLResponse, include_in_schema=False)
async def index():
    return HTMLResponse((_STATIC / "status.html").read_text(encoding="utf-8"))
