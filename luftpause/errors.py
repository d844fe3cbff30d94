"""The root of luftpause's own exceptions, and what each service's base adds.

Every exception a service defines derives from its service's base (``SchedulerError``,
``DataplaneError``, ``PickerError``, ``RuntimeServiceError``), and those and the shared
package's own from ``LuftpauseError``: ``except LuftpauseError`` catches what luftpause
raised on purpose and nothing a library raised. Each keeps the standard base it had
(``ValueError``, ``LookupError``, ``OSError``...), so code that catches those still does.
"""

from __future__ import annotations


class LuftpauseError(Exception):
    """An error luftpause raised on purpose (see the module doc)."""
