"""The error every request parser raises (launch/server/: openai_api.py, chat_api.py, structured_api.py,
http_body.py)."""
from __future__ import annotations


class BadRequest(ValueError):
    """-> HTTP `status` with {"error": {"message", "type", "code"}}."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status
