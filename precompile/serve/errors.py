"""The server's exception policy, in one place: what each exception a request can end in is answered.

Every handler runs its work through ``answer`` (service.py), which asks ``refusal(e)`` what an
exception means. Codes are gRPC's (and Triton's ``TRITONSERVER_Error`` kinds); each protocol maps
them to HTTP statuses:

    code (gRPC status)   HTTP /predict, /v1  HTTP /v2   raised for
    INVALID_ARGUMENT     400                 400        a body that is not JSON, or not a JSON object
                         422                 400        a field of the wrong kind, a value the codec
                                                        refuses, a guard's refusal, outputs JSON cannot carry
    NOT_FOUND            404                 404        an unknown model or version
    PERMISSION_DENIED    403                 403        a reload or repository control the server's
                                                        options forbid
    RESOURCE_EXHAUSTED   413                 413        a body over --max-body-bytes (limits.py)
    CANCELLED            499                 499        the client hung up: mid-body, or while its
                                                        call waited (never sent: nobody reads it)
    UNAVAILABLE          503                 503        nothing loaded yet, a full batch or instance
                                                        queue (instances.py), closing
    INTERNAL             500                 500        anything else: a bug or a runtime failure

The client's refusals (4xx) are counted by reason (``precompile_rejections_total``) and logged in
one line without a traceback; UNAVAILABLE is the server's state, one line too. Only INTERNAL is the
server's fault: logged with its traceback. A handler never catches ``Exception`` itself, so no
catch-all can turn a refusal into a 5xx.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from starlette.requests import ClientDisconnect

from loader import BatcherFull, GuardError, LoaderError

from .codec import BodyError, NotJSONObject
from .instances import InstancesClosed, InstancesFull
from .metrics import guard_reason
from .reload import ReloadRefused


class Code(enum.Enum):
    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    NOT_FOUND = "NOT_FOUND"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    CANCELLED = "CANCELLED"
    UNAVAILABLE = "UNAVAILABLE"
    INTERNAL = "INTERNAL"


CLIENT_CLOSED = 499  # nginx's "client closed request", as grpc-gateway maps CANCELLED


class Refused(Exception):
    """A request the server answers with ``code`` and this message; ``reason`` labels it in metrics."""

    def __init__(self, code: Code, message: str, reason: str | None = None, *, malformed: bool = False):
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.malformed = malformed  # not JSON, or not an object: 400 on every route


class ClientGone(Refused):
    """The client hung up while its call waited (its queued call is dropped)."""

    def __init__(self) -> None:
        super().__init__(Code.CANCELLED, "the client disconnected before its answer was ready", "disconnected")


@dataclass(frozen=True)
class Protocol:
    """How one family of endpoints writes a refusal: its statuses and its error body."""

    name: str
    invalid_status: int  # INVALID_ARGUMENT: 422 (FastAPI's convention) or 400 (the v2 protocol)
    error_key: str  # "detail" or "error"

    def status(self, code: Code, *, malformed: bool = False) -> int:
        if code is Code.INVALID_ARGUMENT:
            return 400 if malformed else self.invalid_status
        return _STATUS[code]

    def body(self, refused: Refused) -> dict[str, Any]:
        body: dict[str, Any] = {self.error_key: str(refused)}
        if refused.reason is not None and self.error_key == "detail":
            body["reason"] = refused.reason
        return body


_STATUS = {
    Code.NOT_FOUND: 404,
    Code.PERMISSION_DENIED: 403,
    Code.RESOURCE_EXHAUSTED: 413,
    Code.CANCELLED: CLIENT_CLOSED,
    Code.UNAVAILABLE: 503,
    Code.INTERNAL: 500,
}

API = Protocol("api", 422, "detail")  # /predict, /v1/..., everything outside /v2
OIP = Protocol("v2", 400, "error")  # the Open Inference Protocol


def refusal(e: Exception) -> Refused | None:
    """What the policy makes of ``e``: a refusal, or None for the server's own fault (INTERNAL)."""
    if isinstance(e, Refused):
        return e
    if isinstance(e, ClientDisconnect):
        return Refused(Code.CANCELLED, "the client disconnected while sending the body", "disconnected")
    if isinstance(e, GuardError):
        return Refused(Code.INVALID_ARGUMENT, str(e), guard_reason(e))
    if isinstance(e, BodyError):
        return Refused(Code.INVALID_ARGUMENT, str(e), "invalid_body", malformed=isinstance(e, NotJSONObject))
    if isinstance(e, ReloadRefused):
        return Refused(Code.PERMISSION_DENIED, str(e))
    if isinstance(e, (BatcherFull, InstancesFull)):
        return Refused(Code.UNAVAILABLE, str(e), "queue_full")
    if isinstance(e, (LoaderError, InstancesClosed)):  # nothing loaded yet, or closing with the server
        return Refused(Code.UNAVAILABLE, str(e))
    return None


def invalid(message: str) -> Refused:
    """A malformed request (INVALID_ARGUMENT, counted as invalid_body): what each protocol's decoder raises."""
    return Refused(Code.INVALID_ARGUMENT, message, "invalid_body")


def internal(e: Exception) -> Refused:
    """The refusal an unexpected exception is answered with (after its traceback is logged)."""
    text = str(e).strip()
    return Refused(
        Code.INTERNAL, f"internal error: {type(e).__name__}: {text.splitlines()[0] if text else type(e).__name__}"
    )
