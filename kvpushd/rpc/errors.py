"""The one converter from errors to gRPC statuses (of a call, or of one stream item that failed
alone); anything not in the table is INTERNAL, logged.

Every refusal also carries its structured reason as trailing metadata ``kvpushd-error``: a JSON
object with the error's kind (its class name), the status code name, and the transfer id and peer
it concerns. Callers (the client library, other daemons) match on the kind, never on the text.
"""

from __future__ import annotations

import functools
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, NoReturn, TypeVar

import grpc
import structlog

from ..core import errors as E

log = structlog.get_logger(__name__)

CODES: dict[type[E.KvpushdError], grpc.StatusCode] = {
    E.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    E.NotFound: grpc.StatusCode.NOT_FOUND,
    E.AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
    E.FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    E.ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    E.Unavailable: grpc.StatusCode.UNAVAILABLE,
    E.PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
}

R = TypeVar("R")


def code_for(exc: E.KvpushdError) -> grpc.StatusCode | None:
    """The status code of an expected error; None for a kind the table does not name (a bug)."""
    for cls in type(exc).__mro__:
        if cls in CODES:
            return CODES[cls]
    return None


def refusal(exc: BaseException) -> tuple[str, str, str]:
    """(status code name, kind, message) of a stream item that failed alone: what a call of it would
    have failed with."""
    if isinstance(exc, E.KvpushdError) and (code := code_for(exc)) is not None:
        return code.name, exc.kind, str(exc)
    log.error("unexpected error in a stream item", exc_info=exc)
    return "INTERNAL", type(exc).__name__, f"internal error: {type(exc).__name__}"


async def _abort(exc: BaseException, context: grpc.aio.ServicerContext[Any, Any], method: str) -> NoReturn:
    if isinstance(exc, grpc.aio.AbortError):  # the servicer aborted the call itself
        raise exc
    if isinstance(exc, E.KvpushdError) and (code := code_for(exc)) is not None:
        reason = {"kind": exc.kind, "code": code.name, "transfer_id": exc.transfer_id[:256], "peer": exc.peer[:256]}
        md = (("kvpushd-error", json.dumps(reason, separators=(",", ":"))),)
        await context.abort(code, str(exc), trailing_metadata=md)
    log.error("unexpected error in RPC", method=method, exc_info=exc)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method}: {type(exc).__name__}")


def unary(fn: Callable[[Any, Any, Any], Awaitable[R]]) -> Callable[[Any, Any, Any], Awaitable[R]]:
    @functools.wraps(fn)
    async def wrapper(self: Any, request: Any, context: Any) -> R:
        try:
            return await fn(self, request, context)
        except Exception as e:  # mapped to a status
            await _abort(e, context, fn.__name__)

    return wrapper


def stream(fn: Callable[[Any, Any, Any], AsyncIterator[R]]) -> Callable[[Any, Any, Any], AsyncIterator[R]]:
    @functools.wraps(fn)
    async def wrapper(self: Any, request: Any, context: Any) -> AsyncIterator[R]:
        try:
            async for item in fn(self, request, context):
                yield item
        except Exception as e:  # mapped to a status
            await _abort(e, context, fn.__name__)

    return wrapper
