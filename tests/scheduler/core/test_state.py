"""The state types (state.py): the core's own cheap ``_replace``."""

from __future__ import annotations

import pytest

from luftpause.scheduler import core


def test_replace_changes_exactly_the_named_fields_of_every_state_type():
    """The core's own ``_replace`` (cheaper than namedtuple's) must still be namedtuple's:
    each field by its name, the rest untouched, the same type, a wrong name refused."""
    for cls in (core.AdmissionLimit, core.Replica, core.Run, core.Turn, core.Lease, core.HeldTurn, core.State):
        base = cls(*[object() for _ in cls._fields])
        for i, name in enumerate(cls._fields):
            marker = object()
            changed = base._replace(**{name: marker})
            assert type(changed) is cls
            assert changed == base[:i] + (marker,) + base[i + 1:]
        first, last = cls._fields[0], cls._fields[-1]
        both = base._replace(**{first: 1, last: 2})
        assert (both[0], both[-1], both[1:-1]) == (1, 2, base[1:-1])
        with pytest.raises(ValueError, match="unexpected field names"):
            base._replace(no_such_field=1)
