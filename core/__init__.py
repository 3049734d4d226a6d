"""Shared vocabulary of autopar: graph IR and capture, cluster spec, plan schema.

Nothing here searches or simulates; planner/, simulator/ and runtime/ import from here,
never the other way round.
"""
