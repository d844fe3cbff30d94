"""``python -m luftpause`` (what ``make run`` runs): the local stack's launcher, which lives
in :mod:`luftpause.dev.launcher` with the rest of the development tooling; no service
imports this module."""

import sys

from luftpause.dev.launcher import main

if __name__ == "__main__":
    sys.exit(main())
