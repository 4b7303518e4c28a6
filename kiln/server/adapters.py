"""LoRA adapters over HTTP, as vLLM serves them: each loaded adapter is a model of `/v1/models` (its base as
`parent`) that a request names in `model`; `POST /v1/load_lora_adapter` (`lora_name`, `lora_path`) and
`POST /v1/unload_lora_adapter` (`lora_name`) change them at run time, behind the API key, and only when the server
was started with `--allow-runtime-lora-updating` (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING). A bad adapter is a 400
naming its file and field, and leaves the server as it was.
"""

from __future__ import annotations

import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from kiln.engine.serving.async_engine import AsyncEngine
from kiln.errors import ConfigError, ModelLoadError
from kiln.lora.manager import LoRAManager
from kiln.server.errors import APIError


class LoadAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1, max_length=200)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1, max_length=200)
    lora_int_id: int | None = None  # vLLM's clients may send it; the name decides


def adapter_cards(lora: LoRAManager | None, parent: str) -> list[dict[str, Any]]:
    """The `/v1/models` entries of the registered adapters."""
    if lora is None:
        return []
    return [
        {
            "id": r.lora_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "kiln",
            "root": r.lora_path,
            "parent": parent,
        }
        for r in list(lora.requests.values())  # copied at once: the engine thread may change it
    ]


async def load_adapter(engine: AsyncEngine, body: LoadAdapterRequest, allowed: bool) -> dict[str, Any]:
    _check_allowed(engine, allowed)
    try:
        lora = await engine.in_engine(lambda: engine.core.load_lora(body.lora_name, body.lora_path))
    except ModelLoadError as exc:  # the adapter's file and field
        raise APIError(400, str(exc), "lora_path") from None
    except ConfigError as exc:
        raise APIError(400, str(exc), "lora_name") from None
    return {"lora_name": lora.lora_name, "lora_int_id": lora.lora_int_id, "loaded": True}


async def unload_adapter(engine: AsyncEngine, body: UnloadAdapterRequest, allowed: bool) -> dict[str, Any]:
    _check_allowed(engine, allowed)
    try:
        await engine.in_engine(lambda: engine.core.unload_lora(body.lora_name))
    except ConfigError as exc:
        raise APIError(400, str(exc), "lora_name") from None
    return {"lora_name": body.lora_name, "unloaded": True}


def _check_allowed(engine: AsyncEngine, allowed: bool) -> None:
    if engine.core.lora is None:
        raise APIError(400, "this server serves no LoRA adapters (start it with --enable-lora)", None, "lora_disabled")
    if not allowed:
        raise APIError(
            403,
            "loading and unloading adapters at run time is off (start the server with --allow-runtime-lora-updating)",
            None,
            "runtime_lora_updating_disabled",
        )
