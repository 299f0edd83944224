"""Errors of the E2B-compatible service: each knows the HTTP status and the Connect code
that the official SDK turns into its matching exception."""

from __future__ import annotations

from connectrpc.code import Code


class ServiceError(Exception):
    """A request the service refuses; the message is one line naming what is wrong."""

    http_status = 500
    connect_code = Code.INTERNAL


class BadRequest(ServiceError):
    http_status = 400
    connect_code = Code.INVALID_ARGUMENT


class Unauthorized(ServiceError):
    http_status = 401
    connect_code = Code.UNAUTHENTICATED


class SandboxNotFound(ServiceError):
    http_status = 404
    connect_code = Code.NOT_FOUND


class Conflict(ServiceError):
    http_status = 409
    connect_code = Code.ALREADY_EXISTS


class NoCapacity(ServiceError):
    """The host cannot take another sandbox now; the client may retry later."""

    http_status = 429
    connect_code = Code.RESOURCE_EXHAUSTED


class SandboxUnavailable(ServiceError):
    """The sandbox exists but cannot run commands (blocked after a restart, or failed)."""

    http_status = 502
    connect_code = Code.UNAVAILABLE
