"""Tests of treadle.core."""
