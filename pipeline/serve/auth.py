"""A FastAPI bearer-key dependency that compares the key in constant time (llama_cpp.server's own `authenticate`
compares with ==). Kept apart from pipeline/serve/work/llamacpp.py so it is importable, and tested, without the
[gguf-serve] extra."""
from __future__ import annotations

import hmac

from fastapi import Depends, HTTPException
from fastapi.security import HTTPBearer


def bearer_check(key: str | None):
    """llama_cpp.server's `authenticate` dependency (the same 401), comparing the key in constant time."""
    bearer = HTTPBearer(auto_error=False)

    async def check(authorization=Depends(bearer)):
        if key is None:
            return True
        got = authorization.credentials if authorization else ""
        if hmac.compare_digest(got.encode(), key.encode()):
            return got
        raise HTTPException(status_code=401, detail="Invalid API key")

    return check
