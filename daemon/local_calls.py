"""Calling the daemon's own services in-process: the context a gRPC call would have had.

The web page and the job questions (`plait.daemon.job_questions`) ask this daemon's services
the very methods the gRPC server calls, so what they show is what a client would have been
sent; `LocalContext` stands in for the call's context and turns an abort into an exception.
"""

from __future__ import annotations

from typing import NoReturn

import grpc

__all__ = ["LocalCallError", "LocalContext"]


class LocalCallError(Exception):
    """A service refused an in-process call (what a gRPC client would see as its status)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code, self.details = code, details


class LocalContext:
    """The part of `grpc.ServicerContext` the daemon's services use, for in-process calls."""

    def abort(self, code: grpc.StatusCode, details: str) -> NoReturn:
        raise LocalCallError(code, details)

    def is_active(self) -> bool:
        return True
