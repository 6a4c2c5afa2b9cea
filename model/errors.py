"""The error a request's own values raise wherever they are checked (the scheduler, a family, a
runner): a ValueError that carries the request field it is about, so the ingress answers a 400 whose
`param` names it without reading the message. Torch-free."""
from __future__ import annotations


class RequestInvalid(ValueError):
    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message, self.param = message, param
