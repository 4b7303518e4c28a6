"""Errors meant for people: each says what was expected, what was found, and where."""

from __future__ import annotations

# what a client is told when its request fails inside the engine (the traceback goes to the server log)
INTERNAL_ERROR = "internal error while running this request; the server log has the details"


class KilnError(Exception):
    """Base of every error kiln raises on purpose; the CLI prints these as one line, no traceback."""


class ConfigError(KilnError):
    """A bad option or setting."""


class ModelLoadError(KilnError):
    """A checkpoint that cannot be loaded: missing, truncated, corrupt or unsupported."""

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = path
        self.problem = problem


class AdapterError(ModelLoadError):
    """A LoRA adapter that cannot be used with this model: `path` is the adapter's file at fault, `field` the config
    field or tensor name (kiln.lora.checkpoint)."""

    def __init__(self, path: str, field: str, problem: str) -> None:
        super().__init__(path, f"{field}: {problem}")
        self.field = field


class RequestError(KilnError):
    """A request that cannot be served (too long, bad sampling parameters, ...); fails only that request."""

    def __init__(self, message: str, request_id: str | None = None, param: str | None = None) -> None:
        where = f" (request {request_id})" if request_id is not None else ""
        super().__init__(f"{message}{where}")
        self.request_id = request_id
        self.param = param


class WorkerFailure(KilnError):
    """A rank of a multi-device engine died or a collective failed: the engine cannot go on (kiln.distributed)."""
