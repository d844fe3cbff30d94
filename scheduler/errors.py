"""The scheduler's exceptions derive from SchedulerError (luftpause/errors.py)."""

from luftpause.errors import LuftpauseError


class SchedulerError(LuftpauseError):
    """An error the scheduler raised on purpose."""
