"""LoRA adapters over HTTP, as vLLM serves them: each loaded adapter is a model of its own in /v1/models (`parent`:
the base model's id) that the `model` field of a completion selects; POST /v1/load_lora_adapter and
/v1/unload_lora_adapter (body {"lora_name": ..., "lora_path": ...}) change them at run time, behind the API key
like every /v1 path. An adapter that cannot load is a 400 OpenAI error object naming the problem."""
from fastapi import FastAPI
from fastapi.responses import PlainTextResponse

from quant_serve.server.protocol import APIError, RequestModel
from quant_serve.server.serving import ServingContext


class LoadLoRAAdapterRequest(RequestModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(RequestModel):
    lora_name: str
    lora_int_id: int | None = None        # vLLM's; the name alone identifies an adapter here


def adapter_cards(ctx: ServingContext, created: int) -> list[dict]:
    lora = ctx.engine.lora
    if lora is None:
        return []
    return [{"id": a.name, "object": "model", "created": created, "owned_by": "quant-serve", "root": a.path,
             "parent": ctx.served_model_names[0], "max_model_len": ctx.max_model_len, "permission": []}
            for a in list(lora.adapters.values())]


def install_lora_routes(app: FastAPI, ctx: ServingContext) -> None:
    engine = ctx.engine

    def enabled(param: str) -> None:
        if engine.lora is None:
            raise APIError(400, "LoRA adapters are not enabled on this server (start it with --enable-lora)",
                           param=param)

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest):
        body.reject_unsupported()
        enabled("lora_name")
        if body.lora_name in ctx.served_model_names:
            raise APIError(400, f"{body.lora_name!r} is the base model's name", param="lora_name")
        try:
            await ctx.async_engine.call(lambda: engine.load_lora_adapter(body.lora_name, body.lora_path))
        except ValueError as e:
            raise APIError(400, str(e), param="lora_path" if "not loaded" not in str(e) else "lora_name") from e
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest):
        body.reject_unsupported()
        enabled("lora_name")
        try:
            await ctx.async_engine.call(lambda: engine.unload_lora_adapter(body.lora_name))
        except ValueError as e:
            code = "model_not_found" if "is not loaded" in str(e) else None
            raise APIError(404 if code else 400, str(e), param="lora_name", code=code) from e
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
