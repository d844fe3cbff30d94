"""The dataplane's exceptions derive from DataplaneError (luftpause/errors.py)."""

from luftpause.errors import LuftpauseError


class DataplaneError(LuftpauseError):
    """An error the dataplane raised on purpose."""
