"""Tests of the decision core (luftpause.scheduler.core), one file a chapter."""
