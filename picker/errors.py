"""The endpoint picker's exceptions derive from PickerError (luftpause/errors.py)."""

from luftpause.errors import LuftpauseError


class PickerError(LuftpauseError):
    """An error the endpoint picker raised on purpose."""
