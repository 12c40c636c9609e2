"""Tests of the offloading connector."""
