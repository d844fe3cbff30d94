"""The runtime's exceptions derive from RuntimeServiceError (luftpause/errors.py; not
Python's RuntimeError)."""

from luftpause.errors import LuftpauseError


class RuntimeServiceError(LuftpauseError):
    """An error the runtime raised on purpose."""
