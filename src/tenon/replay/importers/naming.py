"""Names shared by the importers."""

from __future__ import annotations

import re


def family_of(task: str) -> str:
    """The workflow family (repository) of a SWE-style task id.

    `dask__dask-5510` -> `dask`; `pvlib__pvlib-python-1072` -> `pvlib-python`.
    """
    repo = task.split("__", 1)[-1]
    return re.sub(r"-[0-9]+$", "", repo) or task
