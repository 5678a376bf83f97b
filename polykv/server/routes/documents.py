"""/v1/documents: add (prefill once, compress, share), list, get, delete."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from ..errors import TYPED, APIError, to_api_error
from ..schemas import DocumentRequest
from ..state import ServerState, get_state

__all__ = ["lookup", "router"]

router = APIRouter(tags=["documents"])


def lookup(state: ServerState, doc_id: str, param: str = "document") -> dict:
    info = state.docs.get(doc_id)
    if info is None:
        raise APIError(404, f"Unknown document {doc_id!r}", param=param, code="document_not_found")
    return info


@router.post("/v1/documents")
async def add_document(body: DocumentRequest, state: ServerState = Depends(get_state)):
    ids = await state.in_thread(state.encode, body.text)
    if not ids:
        raise APIError(400, "document text tokenizes to nothing", param="text", code="empty_document")
    if len(ids) >= state.context_length:
        raise APIError(400, f"document has {len(ids)} tokens; the model's context is {state.context_length}",
                       param="text", code="context_length_exceeded")
    try:
        info = await state.on_engine(state.add_document, body.text, body.name)
    except TYPED as exc:
        raise to_api_error(exc, None, param="text") from exc
    return state.public_doc(info)


@router.get("/v1/documents")
async def list_documents(state: ServerState = Depends(get_state)):
    return {"object": "list", "data": [state.public_doc(d) for d in state.docs.values()]}


@router.get("/v1/documents/{doc_id}")
async def get_document(doc_id: str, state: ServerState = Depends(get_state)):
    return state.public_doc(lookup(state, doc_id, "doc_id"))


@router.delete("/v1/documents/{doc_id}")
async def delete_document(doc_id: str, state: ServerState = Depends(get_state)):
    info = lookup(state, doc_id, "doc_id")
    try:
        await state.on_engine(state.remove_document, info)
    except TYPED as exc:
        raise to_api_error(exc, None, param="doc_id") from exc
    return {"id": doc_id, "object": "document", "deleted": True}
