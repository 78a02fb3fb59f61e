"""The mHC functions, re-exported from `dsv41.ref.mhc` (their one definition) for code that imports them from the
model package; new code imports `dsv41.ref.mhc`."""

from ..ref.mhc import *  # noqa: F401,F403
from ..ref.mhc import __all__  # noqa: F401
