"""The numeric formats, re-exported from `dsv41.ref.formats` (their one definition) for code that imports them
from the model package; new code imports `dsv41.ref.formats`."""

from ..ref.formats import *  # noqa: F401,F403
from ..ref.formats import __all__  # noqa: F401
