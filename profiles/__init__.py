"""The bundled device profiles: one JSON file per device type (schema in docs/profiles.md).

This package holds data.  The code that finds, reads and validates a profile is
``autopar.core.profile_schema``; its public names are offered here as well, so
``from autopar.profiles import load_profile`` reads as where the profiles are.
"""
from __future__ import annotations

from autopar.core.profile_schema import (COLLECTIVE_ROW_KEYS, DEVICE_KINDS, DTYPES, EFFICIENCY_KINDS, LINK_LEVELS,
                                         OP_ROW_KEYS, OPTIONAL_KEYS, OVERHEAD_KEYS, PROFILE_KEYS, REQUIRED_KEYS,
                                         SYNC_ROW_KEYS, ProfileError, available_profiles, load_profile, profile_path,
                                         validate_profile)

__all__ = ["COLLECTIVE_ROW_KEYS", "DEVICE_KINDS", "DTYPES", "EFFICIENCY_KINDS", "LINK_LEVELS", "OP_ROW_KEYS",
           "OPTIONAL_KEYS", "OVERHEAD_KEYS", "PROFILE_KEYS", "REQUIRED_KEYS", "SYNC_ROW_KEYS", "ProfileError",
           "available_profiles", "load_profile", "profile_path", "validate_profile"]
