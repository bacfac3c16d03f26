"""Every error leaves as an OpenAI error object with the right status. A 5xx says only that the server failed and
under which error id its log has the details: exception text can hold paths, internals or other requests' data."""
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from quant_serve.server.async_engine import EngineRequestError
from quant_serve.server.protocol import APIError, error_body
from quant_serve.server.serving import ClientDisconnected, internal_error_body


def _error(status: int, message: str, type: str, param=None, code=None, headers=None) -> JSONResponse:
    return JSONResponse(error_body(message, type, param, code), status_code=status, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError):
        # OpenAI clients expect 400 with an error object, never FastAPI's 422 {"detail": [...]}.
        errors = e.errors()
        if errors and errors[0].get("type") == "json_invalid":
            return _error(400, f"the body is not valid JSON: {errors[0].get('ctx', {}).get('error', '')}",
                          "invalid_request_error")
        where = [".".join(str(x) for x in err.get("loc", ()) if x != "body") for err in errors]
        message = "; ".join(f"{w or 'body'}: {err.get('msg', 'invalid')}" for w, err in zip(where[:5], errors))
        return _error(400, message or "invalid request", "invalid_request_error", where[0] if where else None)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        return _error(e.status_code, str(e.detail), "invalid_request_error" if e.status_code < 500 else "server_error",
                      headers=getattr(e, "headers", None))

    @app.exception_handler(ClientDisconnected)
    async def client_gone(request: Request, e: ClientDisconnected):
        return Response(status_code=499)

    @app.exception_handler(EngineRequestError)
    async def engine_error(request: Request, e: EngineRequestError):
        return JSONResponse(internal_error_body(e, f"{request.method} {request.url.path}"), status_code=500)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception):
        return JSONResponse(internal_error_body(e, f"{request.method} {request.url.path}"), status_code=500)
